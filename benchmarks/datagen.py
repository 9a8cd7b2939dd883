#!/usr/bin/env python
"""Synthetic preference-data generation throughput (paper 000, AIF-GEN). Prints a table and writes JSON; not a test.

1. ``openai`` backend against a local OpenAI-compatible server (``tests.helpers.chat_server``, run as a separate
   process) that answers every request after a fixed latency (default 50 ms), at ``max_concurrency`` 1 and 32.
   ``pair`` mode: two requests per sample (prompt, then the chosen/rejected pair). Target: concurrency 32 gives at
   least 20x the samples per second of concurrency 1.
2. ``offline`` backend: samples per second of the generation phase, and end to end (planning, generation, cache,
   assembly and ``save_to_disk``).

Rates are measured over the generation phase (``run_stats["generate_s"]``: from the first request to the last
sample cached). Each configuration runs in a fresh output directory.

    python benchmarks/datagen.py [--latency 0.05] [--seconds 4] [--offline-samples 2000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf_ext.runtime.io import atomic_write_json, machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from rlhf_ext.datagen import OpenAIBackend, generate_dataset  # noqa: E402


def start_server(latency: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.chat_server", "--latency", str(latency)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = proc.stdout.readline().strip()
    if not line.startswith("URL "):
        proc.kill()
        raise RuntimeError(f"chat server did not start: {line!r}")
    return proc, line.split(" ", 1)[1]


def run_openai(url: str, concurrency: int, samples: int, root: Path) -> dict:
    out = root / f"openai-c{concurrency}"
    ds = generate_dataset(
        "continual-piecewise-qa",
        out,
        num_samples=max(1, samples // 4),  # 4 stages
        overrides=[
            "generation.backend=openai",
            f"generation.max_concurrency={concurrency}",
            f"generation.api_base={url}",
        ],
        backend=OpenAIBackend(url, max_concurrency=concurrency),
        progress=False,
    )
    st = ds.run_stats
    return {
        "backend": "openai",
        "max_concurrency": concurrency,
        "samples": st["generated"],
        "requests": st["backend"]["requests"],
        "generate_s": st["generate_s"],
        "samples_per_s": st["generated"] / st["generate_s"],
        "requests_per_s": st["backend"]["requests"] / st["generate_s"],
        "end_to_end_s": st["elapsed_s"],
    }


def run_offline(samples: int, root: Path) -> dict:
    start = time.perf_counter()
    ds = generate_dataset("continual-lipschitz", root / "offline", num_samples=samples, progress=False)
    wall = time.perf_counter() - start
    st = ds.run_stats
    return {
        "backend": "offline",
        "max_concurrency": ds.metadata["config"]["generation"]["max_concurrency"],
        "samples": st["generated"],
        "requests": 2 * st["generated"],
        "generate_s": st["generate_s"],
        "samples_per_s": st["generated"] / st["generate_s"],
        "requests_per_s": 2 * st["generated"] / st["generate_s"],
        "end_to_end_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.05, help="Server latency per request (s).")
    parser.add_argument("--seconds", type=float, default=4.0, help="Approximate generation time per openai run.")
    parser.add_argument("--offline-samples", type=int, default=2000, help="Samples per task (9 Lipschitz stages).")
    parser.add_argument("--out", type=Path, default=RESULTS / "datagen.json")
    args = parser.parse_args()

    rows = []
    proc, url = start_server(args.latency)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for concurrency in (1, 32):
                # ~ seconds / (2 requests x latency) samples per worker
                samples = int(args.seconds / (2 * args.latency) * concurrency)
                rows.append(run_openai(url, concurrency, samples, Path(tmp)))
            rows.append(run_offline(args.offline_samples, Path(tmp)))
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    speedup = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    header = f"{'backend':8s} {'concurrency':>11s} {'samples':>8s} {'requests':>8s} {'gen s':>7s} "
    header += f"{'samples/s':>10s} {'requests/s':>10s} {'end-to-end s':>12s}"
    print(header)
    for r in rows:
        print(
            f"{r['backend']:8s} {r['max_concurrency']:11d} {r['samples']:8d} {r['requests']:8d} {r['generate_s']:7.2f} "
            f"{r['samples_per_s']:10.1f} {r['requests_per_s']:10.1f} {r['end_to_end_s']:12.2f}"
        )
    verdict = "meets" if speedup >= 20 else "MISSES"
    print(
        f"openai speed-up, concurrency 32 vs 1 at {args.latency * 1000:.0f} ms latency: {speedup:.1f}x "
        f"({verdict} the 20x target)"
    )
    ideal = 1 / (2 * args.latency)
    print(f"(ideal at concurrency 1: {ideal:.1f} samples/s; at 32: {32 * ideal:.0f} samples/s)")
    result = {
        "latency_s": args.latency,
        "rows": rows,
        "openai_speedup_32_vs_1": speedup,
        "target_speedup": 20,
        "machine": machine_info(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
