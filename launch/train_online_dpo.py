"""Iterative (paper 004) or one-step asynchronous (paper 001) online DPO from a recipe.

python launch/train_online_dpo.py --config rlhf_ext/recipes/online_dpo_tiny.yaml [key.sub=value ...]
accelerate launch launch/train_online_dpo.py --config my_online_dpo.yaml train.output_dir=runs/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> dict:
    from rlhf_ext.config import RecipeError, load_recipe
    from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe, run_online_dpo
    from rlhf_ext.recipes import recipe_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML file or packaged recipe name")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. online.num_samples=16")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(OnlineDPORecipe, recipe_path(args.config), args.overrides)
    except RecipeError as e:
        sys.exit(f"error: {e}")
    summary = run_online_dpo(recipe)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: summary[k] for k in ("mode", "final_policy", "output_dir")}, indent=2))
    return summary


if __name__ == "__main__":
    main()
