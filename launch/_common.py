"""Shared argument handling for the launch scripts: ``--config FILE`` plus overrides, ``key.sub=value`` or TRL-style
``--key value`` (a recipe's fields can be named flat when the name is unique: ``--entropy_cutoff 1.5``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.recipes import recipe_path


def parse_recipe(recipe_cls: type, description: str, argv: list[str] | None = None) -> Any:
    """Parse ``--config`` (+ ``--engine``) and overrides; exit with a clear message on a bad recipe."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="recipe YAML file or packaged recipe name")
    parser.add_argument("--engine", choices=["trl", "openrlhf"], default=None, help="override the recipe's engine")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed
    args, overrides = parser.parse_known_args(argv)
    try:
        recipe = load_recipe(recipe_cls, recipe_path(args.config), overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.engine is not None:
        recipe.engine = args.engine
    return recipe
