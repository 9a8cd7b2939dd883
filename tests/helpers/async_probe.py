"""A picklable generator for testing :class:`~rlhf_ext.online.OneStepAsyncRunner` in thread and process mode.

Its "weights" are a one-element tensor holding the policy version, so every handover can be checked: each batch
reports the version it was generated with as the generator saw it, the process it ran in and its torch threads.
"""

from __future__ import annotations

import os
import time

import torch


class VersionProbe:
    """``generate`` / ``load_weights`` for the runner; fails on batch ``fail_at`` if given."""

    def __init__(self, fail_at: int | None = None, sleep: float = 0.01):
        self.fail_at = fail_at
        self.sleep = sleep
        self.weights = 0

    def generate(self, index: int, version: int) -> dict:
        if index == self.fail_at:
            raise ValueError(f"probe failed while generating batch {index}")
        time.sleep(self.sleep)
        return {"index": index, "weights_used": self.weights, "pid": os.getpid(), "threads": torch.get_num_threads()}

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        if int(weights["version"]) != version:
            raise AssertionError(f"weights of version {int(weights['version'])} published as version {version}")
        if not torch.equal(weights["matrix"], version_weights(version)["matrix"]):
            raise AssertionError(f"the matrix of version {version} arrived as {weights['matrix']}")
        self.weights = version


def version_weights(version: int) -> dict[str, torch.Tensor]:
    """What a learner publishes to a :class:`VersionProbe` after reaching ``version``."""
    matrix = torch.arange(6, dtype=torch.bfloat16).view(2, 3).t() + version  # another dtype, not contiguous
    return {"version": torch.tensor([version]), "matrix": matrix}
