"""The tiny builtin segment reward model, loaded once for the reward-server tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def rm_dir(cache_dir) -> str:
    from rlhf_ext.pipelines.builtins import resolve_model

    return resolve_model("builtin:tiny-segment-rm", cache_dir)


@pytest.fixture(scope="module")
def scorer(rm_dir):
    from rlhf_ext.runtime.token_scores import SegmentScorer

    return SegmentScorer(rm_dir)
