"""Panel (c) of a continual run's ``performance.png`` follows the rule of the text summary: normalised backward
transfer when every ``R[k, k] > 0``, else (the summary's "n/a") the raw transfer ``R[k, T] - R[k, k]``, labelled so."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from rlhf_ext.algos.forgetting import summarize  # noqa: E402
from rlhf_ext.pipelines.continual import format_summary, plot_run  # noqa: E402


def _summary(matrix: list[list[float | None]]) -> dict:
    """A finished run's summary as :class:`ContinualRunner` writes it (three tasks, three steps each)."""
    names = [f"task_{k:02d}" for k in range(len(matrix))]
    return {
        "tasks": names,
        "finished_tasks": len(names),
        "continual_kl_coefs": [0.0] + [0.5] * (len(names) - 1),
        "performance_matrix": matrix,
        "metric": "mean score of the task's reward model on the policy's samples",
        "output_dir": "run",
        "metrics": summarize(matrix).to_dict(),
    }


def _plotted_figure(summary: dict, tmp_path, monkeypatch):
    """Run :func:`plot_run` and return the figure it drew (kept when it is closed)."""
    import matplotlib.pyplot as plt

    closed = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (closed.append(fig), real_close(fig)))
    results = [{"metrics": {"steps": 3, "log_history": [{"step": 3, "loss": 0.5}]}} for _ in summary["tasks"]]
    assert plot_run(summary, results, tmp_path) == {"performance": str(tmp_path / "performance.png")}
    (figure,) = closed
    return figure


# R[k][t]: reward-model scores, negative on the diagonal, so normalising by R[k, k] would flip signs
NEGATIVE = [[-1.0, -1.5, -2.0], [None, -0.4, -0.2], [None, None, 0.3]]


def test_negative_scores_plot_the_raw_backward_transfer_and_say_why(tmp_path, monkeypatch):
    summary = _summary(NEGATIVE)
    assert "backward transfer (norm.): n/a" in format_summary(summary)
    panel = _plotted_figure(summary, tmp_path, monkeypatch).axes[2]
    assert panel.get_title() == "backward transfer, unnormalised\n(normalised is n/a: some R[k,k] <= 0)"
    assert panel.get_ylabel() == "R[k,T] - R[k,k]"
    (mean_line,) = [line for line in panel.get_lines() if line.get_label() == "mean"]
    # T=1: task 0: -1.5 - (-1.0) = -0.5; T=2: task 0: -2.0 - (-1.0) = -1.0, task 1: -0.2 - (-0.4) = +0.2 -> mean -0.4
    assert list(mean_line.get_xdata()) == [1, 2]
    assert list(mean_line.get_ydata()) == pytest.approx([-0.5, -0.4])
    (band,) = panel.collections
    assert band.get_paths()[0].vertices[:, 1].min() == pytest.approx(-1.0)
    assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(0.2)


def test_positive_scores_plot_the_normalised_backward_transfer(tmp_path, monkeypatch):
    summary = _summary([[0.8, 0.4, 0.6], [None, 0.5, 0.25], [None, None, 0.9]])
    assert "backward transfer (norm.): -0.3750" in format_summary(summary)
    panel = _plotted_figure(summary, tmp_path, monkeypatch).axes[2]
    assert panel.get_title() == "normalised backward transfer"
    assert panel.get_ylabel() == "(R[k,T] - R[k,k]) / R[k,k]"
    (mean_line,) = [line for line in panel.get_lines() if line.get_label() == "mean"]
    # T=1: (0.4 - 0.8) / 0.8 = -0.5; T=2: (0.6 - 0.8) / 0.8 = -0.25 and (0.25 - 0.5) / 0.5 = -0.5 -> mean -0.375
    assert list(mean_line.get_ydata()) == pytest.approx([-0.5, -0.375])


def test_one_task_says_backward_transfer_is_not_available(tmp_path, monkeypatch):
    summary = _summary([[0.7]])
    assert "backward transfer (norm.): n/a" in format_summary(summary)
    panel = _plotted_figure(summary, tmp_path, monkeypatch).axes[2]
    assert "n/a" in panel.get_title()
    assert [line for line in panel.get_lines() if line.get_label() == "mean"] == []
    assert [text.get_text() for text in panel.texts] == ["n/a: one task, no later snapshot to compare with"]
