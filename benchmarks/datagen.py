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

3. ``--offline-scale`` (issue 28): the ``offline`` backend at 100k and (without ``--quick``) 1M samples, 1 vs 2
   worker processes, each run a fresh subprocess: samples per second end to end and in the generation phase, and the
   peak RSS of the whole process tree (parent plus workers, polled every 20 ms with ``psutil``) and each process's
   own peak (``VmHWM`` from ``/proc``: ``vmhwm_parent_mb``, ``vmhwm_workers_mb``). ``--samples N [N ...]`` and
   ``--workers W [W ...]`` choose the sizes and worker counts (e.g. the 1M figure alone: ``--samples 1000000
   --workers 1 --rounds 1``, written to ``datagen_scale_1000000_w1.json``). ``--baseline-repo``
   measures another checkout (e.g. main before issue 28) at 100k with 1 worker, for the before/after figure. The
   sharded speedup is the wall-time ratio 1 worker / 2 workers, printed beside ``machine_probe(parallelism=True)``
   taken before and after (2.0: two idle cores; on a shared machine less), and as a fraction of that parallelism.
   Summary rows: "data generate offline, peak RSS at N samples" (against the 250 MB bound) and "sharded speedup on 2
   cores". Wall times, because the work is spread over processes: the only figure here a loaded machine distorts.

    python benchmarks/datagen.py [--latency 0.05] [--seconds 4] [--offline-samples 2000]
    python benchmarks/datagen.py --offline-scale [--quick] [--baseline-repo DIR] [--samples N ...] [--workers W ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

from _timing import machine_probe, spread, summary_row  # noqa: E402

from rlhf_ext.datagen import OpenAIBackend, generate_dataset  # noqa: E402

RSS_BOUND_MB = 250
STAGES = 9  # continual-lipschitz: --num-samples is per task, one task's worth per stage
CHILD = """
import json, sys, time
t0 = time.perf_counter()
from rlhf_ext.datagen import generate_dataset
ds = generate_dataset("continual-lipschitz", sys.argv[1], num_samples=int(sys.argv[2]), progress=False, **WORKERS)
print("RESULT " + json.dumps({"wall_s": time.perf_counter() - t0, "run": ds.run_stats}))
"""


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


def run_scale(samples: int, workers: int, root: Path, repo: Path = REPO) -> dict:
    """One offline run of ``samples`` samples in a fresh subprocess (code from ``repo``); peak RSS of its tree."""
    import psutil

    out = root / f"scale-{samples}-w{workers}-{len(list(root.iterdir()))}"
    code = CHILD.replace("**WORKERS", f"workers={workers}" if workers > 1 else "")
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out), str(samples // STAGES)],
        env=env,
        cwd=repo,  # `python -c` puts the working directory first on sys.path
        stdout=subprocess.PIPE,
        text=True,
    )
    peak, hwm = 0, {}  # hwm: pid -> VmHWM (kB), the kernel's own peak, read until the process is gone
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [parent, *parent.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.Error:
            pass
        for p in tree:
            with contextlib.suppress(OSError):  # an exited process (a zombie's status has no VmHWM line): keep the last
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM"):
                        hwm[p.pid] = int(line.split()[1])
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    text = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"offline run failed (exit {proc.returncode}): {text[-500:]}")
    result = json.loads(text.split("RESULT ", 1)[1])
    run = result["run"]
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    return {
        "samples": run["planned"],
        "workers": workers,
        "repo": str(repo),
        "peak_rss_mb": round(peak / 2**20, 1),
        "vmhwm_parent_mb": round(hwm.get(proc.pid, 0) / 1024, 1),
        "vmhwm_workers_mb": [round(v / 1024, 1) for pid, v in sorted(hwm.items()) if pid != proc.pid],
        "wall_s": round(wall, 2),
        "generate_s": run["generate_s"],
        "samples_per_s_end_to_end": round(run["planned"] / wall, 1),
        "samples_per_s_generate": round(run["planned"] / run["generate_s"], 1),
        "assemble_s": round(run["elapsed_s"] - run["generate_s"], 2),
    }


def offline_scale(args) -> None:
    sizes = args.samples or ([100_000] if args.quick else [100_000, 1_000_000])
    rounds = args.rounds
    rows, summary = [], []
    probe_before = machine_probe(parallelism=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.baseline_repo is not None:
            rows.append({**run_scale(sizes[0], 1, root, args.baseline_repo), "contender": "baseline"})
        for samples in sizes:
            for r in range(rounds if samples == sizes[0] else 1):
                for workers in args.workers if r % 2 == 0 else args.workers[::-1]:  # order alternating
                    rows.append({**run_scale(samples, workers, root), "contender": "ours", "round": r})
                    print(json.dumps(rows[-1]), flush=True)
    probe_after = machine_probe(parallelism=True)
    machine = {**probe_before, "parallelism_after": probe_after["parallelism"]}
    parallelism = min(probe_before["parallelism"], probe_after["parallelism"])
    speedups = {}
    for samples in sizes:
        ours = [
            r
            for r in rows
            if r["contender"] == "ours" and r["samples"] >= samples * 0.99 and r["samples"] <= samples * 1.01
        ]
        one = [r for r in ours if r["workers"] == 1]
        two = [r for r in ours if r["workers"] == 2]
        rss = spread([r["peak_rss_mb"] for r in one or two])
        n = f"{samples // 1000}k" if samples < 1_000_000 else f"{samples // 1_000_000}M"
        summary.append(
            summary_row(
                f"data generate offline, peak RSS at {n} samples",
                f"{rss['median']:.0f} MB",
                f"bound {RSS_BOUND_MB} MB",
                {k: v / RSS_BOUND_MB if k != "n" else v for k, v in rss.items()},
                f"<= {RSS_BOUND_MB} MB (ratio <= 1)",
                machine,
                unit="x the bound",
            )
        )
        if not (one and two):
            continue
        ratio = spread([a["wall_s"] / b["wall_s"] for a, b in zip(one, two)])
        gen_ratio = spread([a["generate_s"] / b["generate_s"] for a, b in zip(one, two)])
        speedups[n] = {
            "wall": ratio,
            "generate_phase": gen_ratio,
            "fraction_of_parallelism": ratio["median"] / parallelism,
        }
        summary.append(
            summary_row(
                f"data generate offline, sharded speedup on 2 cores at {n} samples",
                f"{spread([r['wall_s'] for r in two])['median']:.1f} s (2 workers)",
                f"{spread([r['wall_s'] for r in one])['median']:.1f} s (1 worker)",
                ratio,
                f">= 1.8x on 2 idle cores (machine parallelism now {parallelism:.2f}; "
                f"{ratio['median'] / parallelism:.0%} of it)",
                machine,
                unit="x wall time, 1 worker / 2 workers",
            )
        )
    header = f"{'contender':9s} {'samples':>8s} {'workers':>7s} {'peak RSS MB':>11s} {'wall s':>7s} {'gen s':>7s} "
    print(header + f"{'assemble s':>10s} {'samples/s':>9s}")
    for r in rows:
        print(
            f"{r['contender']:9s} {r['samples']:8d} {r['workers']:7d} {r['peak_rss_mb']:11.1f} {r['wall_s']:7.1f} "
            f"{r['generate_s']:7.1f} {r['assemble_s']:10.1f} {r['samples_per_s_end_to_end']:9.0f}"
        )
    for n, sp in speedups.items():
        wall = sp["wall"]
        print(
            f"sharded speedup at {n}: {wall['median']:.2f}x wall [{wall['p25']:.2f}-{wall['p75']:.2f}]"
            f", generation phase {sp['generate_phase']['median']:.2f}x; machine parallelism {parallelism:.2f} "
            f"({sp['fraction_of_parallelism']:.0%} of it)"
        )
    default = "datagen_scale_quick.json" if args.quick else "datagen_scale.json"
    if args.samples:
        default = f"datagen_scale_{'_'.join(map(str, sizes))}_w{'_'.join(map(str, args.workers))}.json"
    out = args.out or RESULTS / default
    result = {
        "rows": rows,
        "speedups": speedups,
        "machine": machine,
        "summary": summary,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine_info": machine_info(),
        "note": "wall times of separate processes on a shared machine: read them beside the parallelism probe",
    }
    atomic_write_json(out, result)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.05, help="Server latency per request (s).")
    parser.add_argument("--seconds", type=float, default=4.0, help="Approximate generation time per openai run.")
    parser.add_argument("--offline-samples", type=int, default=2000, help="Samples per task (9 Lipschitz stages).")
    parser.add_argument("--offline-scale", action="store_true", help="Peak RSS and 1 vs 2 workers at 100k/1M samples.")
    parser.add_argument("--quick", action="store_true", help="--offline-scale at 100k samples only.")
    parser.add_argument("--samples", type=int, nargs="+", default=None, help="--offline-scale: sample counts.")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="--offline-scale: worker counts.")
    parser.add_argument("--rounds", type=int, default=3, help="--offline-scale: 1-vs-2-worker rounds at 100k.")
    parser.add_argument(
        "--baseline-repo",
        type=Path,
        default=None,
        help="--offline-scale: also run this checkout's code at 100k, 1 worker (before figure).",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON to write (default under benchmarks/results/).")
    args = parser.parse_args()
    if args.offline_scale or args.quick:
        offline_scale(args)
        return
    args.out = args.out or RESULTS / "datagen.json"

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
