#!/usr/bin/env python
"""Continual RLHF over a task sequence (paper 000): per-task policy training with the KL to the previous task's
policy, frozen snapshots, the performance matrix and forgetting metrics. The recipe's ``algorithm`` picks the policy
stage: ``dpo`` (continual DPO) or ``ppo`` (CPPO-style continual PPO, e.g. ``--config continual_ppo_tiny``).

    python launch/train_continual.py --config recipes/continual_dpo_tiny.yaml [key.sub=value ...]
    accelerate launch launch/train_continual.py --config my_continual.yaml
    deepspeed launch/train_continual.py --config my_continual.yaml train.trl_args='{deepspeed: ds_zero2.json}'

A thin wrapper around :func:`rlhf_ext.pipelines.continual.run_continual`; ``rlhf-ext train continual`` is the same.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from rlhf_ext.config import RecipeError, load_recipe
    from rlhf_ext.pipelines.continual import TaskSequenceError, format_summary, run_continual
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.recipes import recipe_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML file or packaged recipe name")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. continual.continual_kl_coef=0.5")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(ContinualRecipe, recipe_path(args.config), args.overrides)
        summary = run_continual(recipe)
    except (RecipeError, TaskSequenceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
