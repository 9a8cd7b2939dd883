"""The one timing method every speed figure uses, and the row format of `make bench`'s summary table.

Contenders run side by side in one process, one torch thread, in interleaved rounds (A B A B ..., the order
alternating so neither always runs first), timed in CPU time of the calling thread. A round's ratio is ours/theirs on
that round; the figure is the median of those paired ratios with p25-p75. On a machine shared with other jobs the load
moves both contenders of a round alike, so the ratio holds where wall time does not. A machine probe is printed
beside each figure: ``cpu_share`` (CPU seconds per wall second of a fixed single-thread loop: 1.0 = a core of our own)
and ``parallelism`` (two single-thread processes side by side vs one after the other: 2.0 on two idle cores).

Every benchmark that feeds the table writes ``"summary": [row, ...]`` in its JSON (``summary_row``); ``bench.py``
(``make bench``) collects them into ``benchmarks/results/summary.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def spread(values: list[float]) -> dict[str, float]:
    """Median and quartiles (p25, p75) of ``values``; ``n`` the count."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": median, "p25": q1, "p75": q3, "n": len(values)}


def cpu_clock() -> float:
    """CPU seconds of the calling thread (other threads' and processes' work is not counted)."""
    return time.thread_time()


def interleaved(
    contenders: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1, clock: Callable[[], float] = cpu_clock
) -> dict[str, list[float]]:
    """Time each contender once per round, the order rotating every round; ``warmup`` untimed rounds first.

    Returns ``{name: [seconds per round]}``. Call ``torch.set_num_threads(1)`` (``one_thread()``) before.
    """
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = clock()
            contenders[name]()
            elapsed = clock() - t0
            if r >= warmup:
                times[name].append(elapsed)
    return times


def paired_ratio(times: dict[str, list[float]], ours: str, theirs: str) -> dict[str, float]:
    """Median [p25, p75] over rounds of ``times[ours][i] / times[theirs][i]``."""
    return spread([a / b for a, b in zip(times[ours], times[theirs], strict=True)])


def one_thread() -> None:
    """One torch thread (intra- and inter-op), so CPU time measures the work and not the thread pool's spinning."""
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # the inter-op pool is already set once in this process
        torch.set_num_interop_threads(1)


def _spin(seconds_of_work: int) -> float:
    """A fixed amount of single-threaded matmul work; returns its wall time."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(seconds_of_work):
        b = a
        for _ in range(400):
            b = (b @ a).tanh()
    return time.perf_counter() - t0


def cpu_share(seconds: float = 0.2) -> float:
    """CPU seconds per wall second of a single-thread busy loop now: 1.0 when a core is ours, 0.5 when shared by two."""
    t0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - t0 < seconds:
        for i in range(1000):
            x += i * i
    return (time.thread_time() - c0) / (time.perf_counter() - t0)


def machine_parallelism(work: int = 2) -> float:
    """How much faster two single-threaded processes finish side by side than one after the other, right now:
    2.0 on two idle cores, ~1.0 when other processes already use them. The ceiling for any parallel speedup."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        pool.map(_spin, [0, 0])  # start-up
        t0 = time.perf_counter()
        pool.map(_spin, [work])
        pool.map(_spin, [work])
        serial = time.perf_counter() - t0
        t0 = time.perf_counter()
        pool.map(_spin, [work, work])
        parallel = time.perf_counter() - t0
    return serial / parallel


def machine_probe(parallelism: bool = False) -> dict[str, float]:
    """The probe printed beside a figure: ``cpu_share`` always, ``parallelism`` when asked (it costs ~2 s)."""
    import os

    probe = {"cpu_share": round(cpu_share(), 3), "load_average_1min": round(os.getloadavg()[0], 2)}
    if parallelism:
        probe["parallelism"] = round(machine_parallelism(), 3)
    return probe


def commit() -> str:
    """The repository's short commit hash (``+dirty`` when tracked files other than results changed), or ``unknown``."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        changed = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"]
        dirty = subprocess.run(changed, cwd=ROOT, capture_output=True, text=True)  # results: written by the run itself
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def summary_row(
    figure: str,
    ours: str,
    alternative: str,
    ratio: dict[str, float],
    target: str,
    machine: dict[str, float],
    unit: str = "x CPU time",
) -> dict[str, Any]:
    """One row of ``benchmarks/results/summary.md``: ``ratio`` is a ``spread`` (ours / alternative unless ``unit``
    says otherwise), ``target`` the issue's bound as text (e.g. ``"<= 1.005x"``), ``machine`` a ``machine_probe``."""
    return {
        "figure": figure,
        "ours": ours,
        "alternative": alternative,
        "ratio": ratio,
        "unit": unit,
        "target": target,
        "machine": machine,
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
    }
