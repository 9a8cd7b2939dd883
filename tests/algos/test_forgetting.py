"""Forgetting metrics on a hand-made performance matrix, and their input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlhf_ext.continual import (
    average_performance,
    backward_transfer,
    backward_transfer_curve,
    forgetting,
    summarize,
    task_curves,
)

# R[k, t]: task k evaluated by the checkpoint at the end of task t. Below the diagonal: not trained yet.
R = [
    [0.80, 0.85, 0.40],
    [0.10, 0.90, 0.81],
    [0.20, 0.30, 0.70],
]


def test_normalized_backward_transfer_hand_computed():
    # k=0: (0.40 - 0.80) / 0.80 = -0.5 ; k=1: (0.81 - 0.90) / 0.90 = -0.1
    assert backward_transfer(R) == pytest.approx(-0.3)
    assert backward_transfer(np.array(R)) == pytest.approx(-0.3)
    assert backward_transfer(torch.tensor(R)) == pytest.approx(-0.3)


def test_absolute_backward_transfer_forgetting_and_average():
    assert backward_transfer(R, normalized=False) == pytest.approx((-0.40 - 0.09) / 2)
    # forgetting uses the best earlier value: k=0 peaked at 0.85 (after task 1), k=1 at 0.90
    assert forgetting(R) == pytest.approx(((0.85 - 0.40) + (0.90 - 0.81)) / 2)
    assert average_performance(R) == pytest.approx((0.40 + 0.81 + 0.70) / 3)


def test_curves():
    curve = backward_transfer_curve(R)
    assert curve["checkpoint"] == [1, 2]
    assert curve["mean"] == pytest.approx([0.0625, -0.3])  # T=1: only task 0, (0.85 - 0.8) / 0.8
    assert curve["min"] == pytest.approx([0.0625, -0.5])
    assert curve["max"] == pytest.approx([0.0625, -0.1])
    assert task_curves(R) == [pytest.approx([0.80, 0.85, 0.40]), pytest.approx([0.90, 0.81]), [0.70]]


def test_values_below_the_diagonal_are_not_read():
    r = np.array(R)
    r[1, 0] = r[2, 0] = r[2, 1] = np.nan  # future tasks not evaluated
    assert backward_transfer(r) == pytest.approx(-0.3)
    assert forgetting(r) == pytest.approx(forgetting(R))
    assert summarize(r).average_performance == pytest.approx(average_performance(R))


def test_summary_and_single_task():
    s = summarize(R)
    assert s.num_tasks == 3 and s.newest_task_performance == pytest.approx(0.70)
    assert s.backward_transfer == pytest.approx(-0.3)
    assert s.to_dict()["backward_transfer_curve"]["mean"] == pytest.approx([0.0625, -0.3])
    one = summarize([[0.6]])
    assert one.backward_transfer is None and one.forgetting is None and one.average_performance == 0.6
    with pytest.raises(ValueError, match="at least 2 tasks"):
        backward_transfer([[0.6]])


def test_scores_that_can_be_negative_use_absolute_transfer():
    scores = [[-1.0, -2.0], [0.0, 3.0]]
    with pytest.raises(ValueError, match=r"divides by R\[k, k\].*task 0.*normalized=False"):
        backward_transfer(scores)
    assert backward_transfer(scores, normalized=False) == pytest.approx(-1.0)
    s = summarize(scores)
    assert s.backward_transfer is None and s.backward_transfer_absolute == pytest.approx(-1.0)


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        ([[0.5, 0.4, 0.3], [0.1, 0.6, 0.2]], "square K x K"),
        ([0.5, 0.4], "square K x K"),
        (np.zeros((0, 0)), "empty"),
        ([[0.5, math.nan], [0.1, 0.6]], r"NaN/inf at R\[0, 1\]"),
        ([[0.5, 0.4], [0.1, math.inf]], r"NaN/inf at R\[1, 1\]"),
        ([[0.0, 0.4], [0.1, 0.6]], r"R\[k, k\], which is 0 for task 0"),
    ],
)
def test_invalid_matrices_raise_clear_errors(matrix, message):
    with pytest.raises(ValueError, match=message):
        backward_transfer(matrix)
