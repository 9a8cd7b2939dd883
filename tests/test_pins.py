"""The extras' pins match what the engines accept (issue 25): read from pyproject.toml and from the installed
OpenRLHF 0.11.2 and TRL 1.16 metadata, so a pin that drifts from its engine fails here."""

from __future__ import annotations

from importlib.metadata import metadata, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, dict[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {"base": {Requirement(r).name: Requirement(r) for r in project["dependencies"]}}
    for extra, reqs in project["optional-dependencies"].items():
        out[extra] = {Requirement(r).name: Requirement(r) for r in reqs}
    return out


def _engine_requirements(package: str) -> list[Requirement]:
    return [Requirement(r) for r in metadata(package).get_all("Requires-Dist")]


def _in_extra(requirement: Requirement, extra: str) -> bool:
    return requirement.marker is not None and requirement.marker.evaluate({"extra": extra})


def test_openrlhf_cpu_extra_carries_openrlhfs_exact_pins():
    """transformers, deepspeed and ray are pinned exactly as OpenRLHF 0.11.2 pins them (its code touches their
    internals); the README says that installing the extra replaces a newer transformers."""
    extras = _extras()
    assert str(extras["openrlhf"]["openrlhf"].specifier) == "==0.11.2" == f"=={version('openrlhf')}"
    pinned = {r.name: r for r in _engine_requirements("openrlhf") if r.marker is None}
    for name in ("transformers", "deepspeed", "ray"):
        assert extras["openrlhf-cpu"][name].specifier == pinned[name].specifier, name
        assert extras["openrlhf-cpu"][name].extras == pinned[name].extras, name
    readme = (ROOT / "README.md").read_text()
    assert "replaces a newer transformers with 5.15.0" in readme


def test_vllm_extra_is_openrlhfs_and_trl_accepts_it():
    extras = _extras()
    ours = extras["vllm"]["vllm"].specifier
    openrlhf_vllm = [r for r in _engine_requirements("openrlhf") if r.name == "vllm" and _in_extra(r, "vllm")]
    assert [str(r.specifier) for r in openrlhf_vllm] == [str(ours)] == ["==0.29.0"]
    trl_vllm = [r for r in _engine_requirements("trl") if r.name == "vllm" and _in_extra(r, "vllm")]
    assert trl_vllm and trl_vllm[0].specifier.contains("0.29.0")


def test_trl_extra_stays_below_1_17():
    trl = _extras()["trl"]["trl"].specifier
    assert trl.contains(version("trl")) and Version(version("trl")).release[:2] == (1, 16)
    assert not trl.contains("1.17.0") and not trl.contains("1.15.2")
    assert _extras()["base"]["transformers"].specifier.contains("5.23.0")  # the base never caps transformers
