"""``benchmarks/bench.py`` (``make bench``) renders summary.md from the "summary" rows of the results JSONs: the rows
in the issue's order whatever the files' order, each figure formatted from its row, a figure without a row shown as
not measured, a JSON without "summary" ignored."""

from __future__ import annotations

import importlib.util
import json

from tests.helpers.readme import ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(figure: str, ours: str, alternative: str, ratio: tuple, target: str, machine: dict, **extra) -> dict:
    median, p25, p75, n = ratio
    return {"figure": figure, "ours": ours, "alternative": alternative,
            "ratio": {"median": median, "p25": p25, "p75": p75, "n": n}, "unit": "x CPU time", "target": target,
            "machine": machine, "date": "2026-11-27", "commit": "abc1234", **extra}  # fmt: skip


def test_render_orders_rows_as_the_issue_and_formats_each_cell(tmp_path, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench, "FIGURES", ["DensePPO step, REINFORCE", "one-step async vs sync", "serve rm"])
    # a_*.json sorts first but holds the later figures: the table follows FIGURES, not the files
    (tmp_path / "a_serve_quick.json").write_text(json.dumps({"summary": [
        row("serve rm vs per-request scoring at concurrency 64", "batched 150 pairs/s, p50 416.4 ms | p99 743.4 ms",
            "per-request 46 pairs/s", (3.2827, 2.8817, 3.6776, 7), ">= 3x", {"cpu_share": 0.52}, unit="x pairs/s"),
        row("something else entirely", "x", "y", (1.0, 1.0, 1.0, 1), "-", {}),
    ]}))  # fmt: skip
    (tmp_path / "b_step.json").write_text(json.dumps({"summary": [
        row("DensePPO step, REINFORCE, vs GRPOTrainer + KL", "1.20 s", "1.21 s", (0.99123, 0.981, 1.05, 9), "< 1.00x",
            {"cpu_share": 0.487, "load_average_1min": 6.5, "parallelism": 1.1}),
    ]}))  # fmt: skip
    (tmp_path / "c_no_summary.json").write_text(json.dumps({"figure": "not a summary"}))
    (tmp_path / "d_list.json").write_text("[1, 2]")

    assert bench.render(tmp_path) == bench.HEADER + "\n" + "\n".join([
        "| figure | ours | alternative | ratio median [p25-p75] | target | machine | date | commit | source |",
        "|---|---|---|---|---|---|---|---|---|",
        "| DensePPO step, REINFORCE, vs GRPOTrainer + KL | 1.20 s | 1.21 s | 0.991 [0.981-1.050] x CPU time (n=9) "
        "| < 1.00x | cpu_share 0.487, load_average_1min 6.5, parallelism 1.1 | 2026-11-27 | abc1234 | b_step.json |",
        "| one-step async vs sync | not measured: no summary row in benchmarks/results/ |  |  |  |  |  |  |  |",
        "| serve rm vs per-request scoring at concurrency 64 | batched 150 pairs/s, p50 416.4 ms \\| p99 743.4 ms "
        "| per-request 46 pairs/s | 3.283 [2.882-3.678] x pairs/s (n=7) | >= 3x | cpu_share 0.52 | 2026-11-27 "
        "| abc1234 | a_serve_quick.json |",
        "| something else entirely | x | y | 1.000 [1.000-1.000] x CPU time (n=1) | - |  | 2026-11-27 | abc1234 "
        "| a_serve_quick.json |",
    ]) + "\n"  # fmt: skip


def test_a_script_without_quick_is_skipped_with_a_line(tmp_path, monkeypatch, capsys):
    bench = load_bench()
    (tmp_path / "plain.py").write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    monkeypatch.setattr(bench, "HERE", tmp_path)
    assert bench.run_quick(["plain.py", "absent.py"]) == []
    assert capsys.readouterr().out.splitlines() == [
        "plain.py: no --quick mode yet, skipped",
        "absent.py: not in this tree, skipped",
    ]
