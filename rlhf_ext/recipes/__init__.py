"""The packaged recipes (``rlhf_ext/recipes/*.yaml``) and recipe lookup: a path, or a packaged recipe's name."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from rlhf_ext.config import RecipeError


def recipe_dir():
    """The folder of the packaged recipes."""
    return resources.files("rlhf_ext") / "recipes"


def recipe_names() -> list[str]:
    """The packaged recipes' names (file names without ``.yaml``)."""
    return sorted(p.name.removesuffix(".yaml") for p in recipe_dir().iterdir() if p.name.endswith(".yaml"))


def recipe_path(name_or_path: str) -> Path:
    """A recipe file: an existing path, or the name of a packaged recipe (with or without ``.yaml``)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    packaged = recipe_dir() / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if packaged.is_file():
        return Path(str(packaged))
    raise RecipeError(
        f"recipe {name_or_path!r} is neither a file nor a packaged recipe; "
        f"packaged recipes: {', '.join(recipe_names())}"
    )
