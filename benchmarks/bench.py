"""``make bench``: each table benchmark's ``--quick`` run, then ``benchmarks/results/summary.md``, one table.

    python benchmarks/bench.py                       # run every script in BENCHMARKS with --quick, then render
    python benchmarks/bench.py async.py serve_rm.py  # run only these, then render
    python benchmarks/bench.py --render              # render summary.md from the JSONs there now; runs nothing

Each script runs in its own process (``python benchmarks/<script> --quick``, which writes
``benchmarks/results/<name>_quick.json``); a script whose ``--help`` has no ``--quick`` is skipped with a line that
says so. The table is made from the ``"summary"`` rows (``_timing.summary_row``) of every ``benchmarks/results/*.json``,
results of record and quick runs alike (the ``source`` column names the file), in the issue's order
(:data:`FIGURES`); a figure of that list with no row yet is shown as not measured.

The machine these run on is 2 CPU cores shared with other jobs: wall times mean little there, so each figure is a
ratio of contenders measured side by side in one process (interleaved rounds, CPU time), printed with the machine
probe taken beside it (``cpu_share``: CPU seconds per wall second of a single-thread loop; ``parallelism``: how much
faster two processes run side by side than one after the other, 2.0 on two idle cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: The scripts ``make bench`` runs with ``--quick``, in the issue's order (edit here to add or drop one). The
#: OpenRLHF make_experience figure comes from ``entropy_fused.py`` (in-process); ``openrlhf_ppo.py`` is a Ray smoke run.
BENCHMARKS = [
    "entropy_fused.py",
    "segment_ppo_step.py",
    "online_dpo_step.py",
    "async.py",
    "serve_rm.py",
    "datagen.py",
]

#: The table's figures in the issue's order: a row goes under the first entry its figure starts with (case-insensitive);
#: rows matching none follow, by file name. An entry without any row is shown as not measured.
FIGURES = [
    "OpenRLHF make_experience, segment vs stock",
    "segment reward production vs stock bandit",
    "DensePPO step, REINFORCE",
    "DensePPO step, GAE",
    "iterative online DPO per pair",
    "one-step async vs sync",
    "serve rm vs per-request scoring at concurrency 1",
    "serve rm vs per-request scoring at concurrency 64",
    "data generate offline, peak RSS",
    "data generate offline, sharded speedup",
]

HEADER = """# Benchmark summary

Written by `python benchmarks/bench.py` (`make bench`) from the `"summary"` rows of `benchmarks/results/*.json`;
`source` names the file (`*_quick.json`: the short run `make bench` makes). Each ratio is the median [p25-p75] over
paired rounds (or repetitions) of contenders measured side by side in one process, with the machine probe taken
beside it: on a shared 2-core machine only such ratios mean something, not wall times (`cpu_share` 1.0 = a core of
our own; `parallelism` 2.0 = two idle cores).
"""

COLUMNS = ["figure", "ours", "alternative", "ratio median [p25-p75]", "target", "machine", "date", "commit", "source"]


def has_quick(script: Path) -> bool:
    """Whether ``script --help`` offers ``--quick``."""
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    return done.returncode == 0 and "--quick" in done.stdout


def run_quick(names: list[str]) -> list[str]:
    """Run ``<script> --quick`` for each name, one after the other; returns the names that failed."""
    failed = []
    for name in names:
        script = HERE / name
        if not script.exists():
            print(f"{name}: not in this tree, skipped", flush=True)
            continue
        if not has_quick(script):
            print(f"{name}: no --quick mode yet, skipped", flush=True)
            continue
        print(f"{name} --quick ...", flush=True)
        started = time.perf_counter()
        code = subprocess.run([sys.executable, str(script), "--quick"]).returncode  # its output goes to ours
        seconds = time.perf_counter() - started
        if code == 0:
            print(f"{name}: done in {seconds:.0f} s", flush=True)
        else:
            failed.append(name)
            print(f"{name}: FAILED (exit {code}) after {seconds:.0f} s", flush=True)
    return failed


def collect(results: Path) -> list[tuple[str, dict]]:
    """``(file name, row)`` for every summary row of every JSON in ``results``, by file name, then row order."""
    rows = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and isinstance(data.get("summary"), list):
            rows.extend((path.name, row) for row in data["summary"])
    return rows


def _place(figure: str) -> int:
    """Index of the first :data:`FIGURES` entry ``figure`` starts with; ``len(FIGURES)`` for none."""
    low = figure.lower()
    return next((i for i, prefix in enumerate(FIGURES) if low.startswith(prefix.lower())), len(FIGURES))


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _ratio(ratio: dict, unit: str) -> str:
    return f"{ratio['median']:.3f} [{ratio['p25']:.3f}-{ratio['p75']:.3f}] {unit} (n={ratio['n']})"


def _machine(machine: dict) -> str:
    return ", ".join(f"{key} {value:.3g}" if isinstance(value, (int, float)) else f"{key} {value}"
                     for key, value in machine.items())  # fmt: skip


def render(results: Path = RESULTS) -> str:
    """The text of ``summary.md`` from the summary rows of the JSONs in ``results``."""
    rows = collect(results)
    lines = [HEADER, _table_line(COLUMNS), "|" + "---|" * len(COLUMNS)]
    for i, prefix in enumerate([*FIGURES, None]):
        mine = [_line(source, row) for source, row in rows if _place(row["figure"]) == i]
        if not mine and prefix is not None:
            mine = [_table_line([prefix, "not measured: no summary row in benchmarks/results/", *[""] * 7])]
        lines += mine
    return "\n".join(lines) + "\n"


def _line(source: str, row: dict) -> str:
    cells = [row["figure"], row["ours"], row["alternative"], _ratio(row["ratio"], row.get("unit", "x CPU time")),
             row["target"], _machine(row["machine"]), row["date"], row["commit"], source]  # fmt: skip
    return _table_line(cells)


def _table_line(cells: list) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scripts", nargs="*", help=f"scripts to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--render", action="store_true", help="only write summary.md from the JSONs there now")
    args = parser.parse_args(argv)
    unknown = [name for name in args.scripts if not (HERE / name).exists()]
    if unknown:
        parser.error(f"no such benchmark script: {', '.join(unknown)} (look in benchmarks/)")
    if args.render and args.scripts:
        parser.error("--render runs nothing: give either --render or script names")
    failed = [] if args.render else run_quick(args.scripts or BENCHMARKS)
    out = RESULTS / "summary.md"
    out.write_text(render(RESULTS))
    print(f"wrote {out.relative_to(HERE.parent)}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
