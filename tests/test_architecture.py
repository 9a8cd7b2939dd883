"""The import contract covers the whole package, and docs/architecture.md draws the contract's layers as they are."""

from __future__ import annotations

import re

import tomllib

from tests.helpers.readme import ROOT

CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
LAYERS = next(c for c in CONTRACTS if c["name"] == "rlhf_ext layers")["layers"]


def _named(layer: str) -> set[str]:
    return {m.strip() for m in re.split(r"[|:]", layer)}


def test_every_top_level_module_is_in_a_layer():
    top = {p.stem for p in (ROOT / "rlhf_ext").glob("*.py") if p.stem != "__init__"}
    top |= {p.parent.name for p in (ROOT / "rlhf_ext").glob("*/__init__.py")}
    in_layers = {m.removeprefix("rlhf_ext.") for layer in LAYERS for m in _named(layer)}
    assert top - in_layers == set(), f"modules in no layer of pyproject.toml's contract: {sorted(top - in_layers)}"
    assert in_layers - top == set(), f"layers name modules that do not exist: {sorted(in_layers - top)}"


def test_architecture_page_draws_the_contract_layers_in_order():
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = page.split("```\n", 2)[1].strip().splitlines()
    assert drawn == LAYERS
