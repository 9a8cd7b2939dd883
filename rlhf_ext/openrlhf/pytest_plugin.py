"""pytest plugin that installs every patch rlhf-ext makes to OpenRLHF 0.11.2 (the Ray-worker set) before a test
session, to run OpenRLHF's own unit tests unchanged with them on::

    make openrlhf-tests OPENRLHF_TESTS=/path/to/OpenRLHF/tests
    # = python -m pytest -p rlhf_ext.openrlhf.pytest_plugin /path/to/OpenRLHF/tests
"""

from __future__ import annotations


def pytest_configure(config) -> None:
    from rlhf_ext.openrlhf.train_ppo_ray import install

    install({"segment": True, "continual": True, "rollout_engine": "hf"}, driver=False)
