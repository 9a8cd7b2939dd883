#!/usr/bin/env python
"""``rlhf-ext serve rm`` under load and under hostile clients. Prints tables and writes JSON; not a test.

All contenders serve the same segment reward model (``builtin:tiny-segment-rm``), 1 torch thread, and take turns on
open connections (the order alternates; in table 1 a turn is 4 requests per connection: ~60 ms at c = 1), so that a
shared machine's load, which changes within seconds, falls on all of them. By default they run in this one process,
beside the client; with ``--processes`` table 1's contenders run each in its own process (``rlhf-ext serve rm``'s
shape: the client shares neither the server's interpreter lock nor its threads), measured from outside.

1. Concurrency (issue 28): requests of one pair each (what OpenRLHF's rollout sends), ``c`` in flight at a time, for
   c = 1, 8, 64. ``batched``: the server as shipped (a batch takes every pair waiting and closes when none is).
   ``per_request``: the same server scoring each request in its own forward pass (``max_batch_size=1``: per-request
   scoring, as OpenRLHF's own ``serve_rm`` does). Reported: the paired ratio of pairs/s (median and p25-p75 over the
   rounds), latency p50/p99, and where the CPU goes per pair, by thread (scoring thread = the models; the event loop
   and the parse/tokenise threads = the server's overhead; the client runs in this process too).
2. Server overhead (issue 28): the same one-pair requests at c = 1 and 64 with scoring stubbed out (every pair
   scores 0), so that only HTTP, parsing, tokenising, batching and thread hand-offs cost: CPU ms per request outside
   the scoring thread and the client, and requests/s; with ``--before REF`` the old server beside the new one.
3. Load (issue 26): 200 requests of 1..8 pairs (900 pairs) sent at once; pairs/s. With ``--before REF`` the old
   server (``rlhf_ext/pipelines/serve_rm.py`` at git REF, on ``http.server``) runs beside the new one.
4. ``--hostile`` (issue 23; needs ``--before``): each server in its own process, measured from outside: a chunked
   body with chunk size ``-1`` followed by ``--flood-mb`` MB, 16 clients sending one byte every 2 s, 500 stalled
   connections, and /health latency during 500 concurrent scoring requests; the server's peak RSS (VmHWM) before and
   after each.

Every answer is checked against in-process e_phi. Each server's first round is a warm-up and is not counted.
Throughput is pairs per wall second (a server's work spans its threads and the client's), so the paired ratio of
rounds is the figure; ``make bench``'s summary rows are the c = 1 and c = 64 ratios with latencies beside them.

    python benchmarks/serve_rm.py [--rounds 5] [--before 609d424] [--hostile] [--out benchmarks/results/serve_rm.json]
    python benchmarks/serve_rm.py --quick     # table 1 at c = 1 and 64 only, 9 rounds -> serve_rm_quick.json
    python benchmarks/serve_rm.py --quick --processes   # the same, each server its own process -> *_processes.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from _timing import machine_probe, spread, summary_row  # noqa: E402

from rlhf_ext.runtime.io import atomic_write_json, machine_info  # noqa: E402
from tests.helpers.reward_client import TOLERANCE, Trickler, distinct_pairs, read_answer, request_head  # noqa: E402

ROLES = {"rm-batcher": "scoring thread (models)", "rm-serve": "event loop (HTTP)", "rm-prepare": "parse + tokenise",
         "rm-http": "request threads (old: HTTP + parse + tokenise)", "rm-accept": "accept loop (old)",
         "MainThread": "client (this process)"}  # fmt: skip
#: The CPU of a server running in its own process (``--processes``): models and overhead together.
SERVER_PROCESS = "server process (all its threads)"
#: Roles whose CPU is not the server's overhead: the models, and the client (which shares this process).
NOT_OVERHEAD = ("scoring thread (models)", "client (this process)", SERVER_PROCESS)


# ------------------------------------------------------------------------------------------------------ servers
def old_module(ref: str):
    """The server module as it was at git ``ref`` (``rlhf_ext/pipelines/serve_rm.py``)."""
    if "serve_rm_before" in sys.modules:
        return sys.modules["serve_rm_before"]
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:rlhf_ext/pipelines/serve_rm.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "serve_rm_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("serve_rm_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_rm_before"] = module
    spec.loader.exec_module(module)
    return module


def start_server(kind: str, scorer, ref: str | None, **settings):
    """A running server: ``new`` (this tree) or ``old`` (git ``ref``), on a free port."""
    if kind == "old":
        old = old_module(ref)
        return old.RewardServer(scorer, old.ServeSettings(port=0, **settings)).start()
    from rlhf_ext.serve.server import RewardServer
    from rlhf_ext.serve.settings import ServeSettings

    return RewardServer(scorer, ServeSettings(port=0, **settings)).start()


class ServerProcess:
    """A server in its own process (``--serve``: ``new`` or ``old`` at git ``ref``): ``url``, ``pid``; no
    ``batcher`` to read batch sizes from."""

    batcher = None

    def __init__(self, kind: str, rm_dir: str, ref: str | None = None, max_batch_size: int | None = None):
        command = [sys.executable, __file__, "--serve", kind, "--model", rm_dir]
        command += ["--before", ref] if ref else []
        command += ["--max-batch-size", str(max_batch_size)] if max_batch_size else []
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.url, self.pid = self.proc.stdout.readline().split()[1], self.proc.pid

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def thread_cpu(servers: dict | None = None) -> dict[str, float]:
    """CPU seconds of every live thread, summed by role (:data:`ROLES`, by thread-name prefix), and of the
    ``servers`` that run in their own processes (:data:`SERVER_PROCESS`; only one is busy at a time)."""
    totals: dict[str, float] = {}
    for server in (servers or {}).values():
        if isinstance(server, ServerProcess):
            cpu = psutil.Process(server.pid).cpu_times()
            totals[SERVER_PROCESS] = totals.get(SERVER_PROCESS, 0.0) + cpu.user + cpu.system
    for thread in threading.enumerate():
        role = next((r for prefix, r in ROLES.items() if thread.name.startswith(prefix)), "other")
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):  # the thread ended meanwhile
            continue
        totals[role] = totals.get(role, 0.0) + seconds
    return totals


# ------------------------------------------------------------------------------------------------------- client
def client(concurrency: int) -> aiohttp.ClientSession:
    """An HTTP client keeping up to ``concurrency`` connections open."""
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))


async def fire(url: str, bodies: list[bytes], concurrency: int, session: aiohttp.ClientSession | None = None
               ) -> tuple[float, list[float], list[dict]]:  # fmt: skip
    """Send ``bodies`` with ``concurrency`` in flight (on ``session``, default a new one); (wall seconds, latencies,
    answers in order)."""
    if session is None:
        async with client(concurrency) as session:
            return await fire(url, bodies, concurrency, session)
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(body: bytes) -> dict:
        async with gate:
            started = time.perf_counter()
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as answer:
                payload = await answer.json(content_type=None)
                assert answer.status == 200, payload
            latencies.append(time.perf_counter() - started)
            return payload

    started = time.perf_counter()
    answers = await asyncio.gather(*(one(body) for body in bodies))
    return time.perf_counter() - started, latencies, answers


def body_of(pairs) -> bytes:
    return json.dumps({"query": [p + r for p, r in pairs], "prompts": [p for p, _ in pairs],
                       "labels": [None] * len(pairs)}).encode()  # fmt: skip


def check(answers: list[dict], expected: list[list[float]]) -> None:
    for answer, values in zip(answers, expected):
        assert all(abs(a - b) <= TOLERANCE for a, b in zip(answer["rewards"], values)), (answer, values)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ------------------------------------------------------------------------------------------------- measurements
def per_pair_in_process(scorer, pairs) -> float:
    """Median seconds to tokenise and score one pair alone, in process (the per-request work without HTTP)."""
    from rlhf_ext.serve.batching import SegmentEvaluator

    evaluator = SegmentEvaluator(scorer)
    times = []
    for prompt, response in pairs:
        started = time.perf_counter()
        evaluator.evaluate([evaluator.encode(prompt, response)])
        times.append(time.perf_counter() - started)
    return statistics.median(times[4:])


def run_rounds(servers: dict, bodies: list[bytes], wanted: list | None, concurrency: int, rounds: int,
               turn: int | None = None) -> dict:  # fmt: skip
    """Each server answers ``bodies`` once per round (round 0 is a warm-up), ``turn`` requests at a time (default all)
    on its own client's open connections: the servers take turns, the order rotating by one per turn, so that a shared
    machine's load, which changes within seconds, falls on all of them. Per server: pairs/s per round (its pairs over
    its summed wall time), latencies, CPU ms per pair by thread role, mean batch size."""
    names, pairs = list(servers), sum(len(json.loads(b)["query"]) for b in bodies)
    starts = list(range(0, len(bodies), turn or len(bodies)))
    rates = {name: [] for name in names}
    latencies = {name: [] for name in names}
    cpu = {name: {} for name in names}
    batches = {name: [0, 0] for name in names}

    async def one_round(round_: int) -> None:
        walls = dict.fromkeys(names, 0.0)
        sessions = {name: client(concurrency) for name in names}
        try:
            for index, begin in enumerate(starts):
                end, first = begin + (turn or len(bodies)), (round_ * len(starts) + index) % len(names)
                for name in names[first:] + names[:first]:
                    server = servers[name]
                    before, b0, p0 = thread_cpu(servers), *batch_counts(server)
                    wall, lat, answers = await fire(f"{server.url}/get_reward", bodies[begin:end], concurrency,
                                                    sessions[name])  # fmt: skip
                    after = thread_cpu(servers)
                    if wanted is not None:
                        check(answers, wanted[begin:end])
                    if round_ == 0:
                        continue
                    walls[name] += wall
                    latencies[name].extend(lat)
                    for role, seconds in after.items():
                        cpu[name][role] = cpu[name].get(role, 0.0) + seconds - before.get(role, 0.0)
                    b1, p1 = batch_counts(server)
                    batches[name][0] += b1 - b0
                    batches[name][1] += p1 - p0
        finally:
            for session in sessions.values():
                await session.close()
        for name in names if round_ else ():
            rates[name].append(pairs / walls[name])

    for round_ in range(rounds + 1):
        asyncio.run(one_round(round_))
    return {name: {"pairs_per_s": spread(rates[name]), "rates": rates[name],
                   "latency_ms": {"p50": 1e3 * percentile(latencies[name], 0.5),
                                  "p99": 1e3 * percentile(latencies[name], 0.99)},
                   "mean_batch": batches[name][1] / batches[name][0] if batches[name][0] else None,
                   "cpu_ms_per_pair": {role: 1e3 * s / (pairs * rounds) for role, s in sorted(cpu[name].items())},
                   "server_overhead_cpu_ms_per_pair": 1e3 * sum(s for role, s in cpu[name].items()
                                                                if role not in NOT_OVERHEAD) / (pairs * rounds)}
            for name in names}  # fmt: skip


def batch_counts(server) -> tuple[int, int]:
    """Batches scored and pairs in them so far; (0, 0) for a server in its own process (not observable)."""
    return (server.batcher.batches, server.batcher.pairs) if server.batcher else (0, 0)


def requests_at(concurrency: int) -> int:
    """One-pair requests per round at ``concurrency``: at least 128 (a round of > 1 s at c = 1, where a request takes
    ~15 ms: shorter rounds measure the machine's noise, not the server), and 4 per connection; the servers take turns
    every ``4 * c`` requests (4 at c = 1: ~60 ms turns)."""
    return max(128, 4 * concurrency)


def ratio(stats: dict, a: str, b: str) -> dict:
    """Paired ratio of pairs/s, ``a`` over ``b``, round by round."""
    return spread([x / y for x, y in zip(stats[a]["rates"], stats[b]["rates"])])


def concurrency_table(scorer, pairs, expected, rounds: int, levels: list[int], ref: str | None,
                      rm_dir: str | None = None) -> dict:  # fmt: skip
    """Table 1; with ``rm_dir`` each contender runs in its own process (``--processes``)."""
    if rm_dir:
        servers = {"batched": ServerProcess("new", rm_dir),
                   "per_request": ServerProcess("new", rm_dir, max_batch_size=1)}  # fmt: skip
    else:
        servers = {"batched": start_server("new", scorer, None),
                   "per_request": start_server("new", scorer, None, max_batch_size=1)}  # fmt: skip
    if ref:
        servers["before"] = start_server("old", scorer, ref)
    results = {}
    try:
        for c in levels:
            n = requests_at(c)
            stats = run_rounds(servers, [body_of([pairs[i]]) for i in range(n)], [[v] for v in expected[:n]], c,
                               rounds, turn=4 * c)  # fmt: skip
            row = results[str(c)] = {"requests_per_round": n, **stats,
                                     "ratio_batched_per_request": ratio(stats, "batched", "per_request")}  # fmt: skip
            if ref:
                row["ratio_batched_before"] = ratio(stats, "batched", "before")
            shown = ", ".join(f"{name} p50 {s['latency_ms']['p50']:.1f} p99 {s['latency_ms']['p99']:.1f} ms"
                              for name, s in stats.items())  # fmt: skip
            r = row["ratio_batched_per_request"]
            print(f"c={c:>3}: batched/per-request {r['median']:.2f}x [{r['p25']:.2f}-{r['p75']:.2f}]"
                  + (f", batched/before {row['ratio_batched_before']['median']:.2f}x" if ref else "")
                  + f"; {shown}; mean batch {stats['batched']['mean_batch'] or float('nan'):.1f}",
                  flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.close()
    return results


def overhead_table(scorer, pairs, rounds: int, ref: str | None) -> dict:
    """The servers' own cost per one-pair request, with scoring stubbed out (every pair scores 0): HTTP, parsing,
    tokenising, batching and the thread hand-offs, new stack against the old one."""
    servers = {"after": start_server("new", scorer, None)}
    if ref:
        servers["before"] = start_server("old", scorer, ref)
    for server in servers.values():
        server.batcher.score_batch = lambda batch: ([0.0] * len(batch), [0] * len(batch))
    results = {}
    try:
        for c in (1, 64):
            n = max(64, 8 * c)
            stats = run_rounds(servers, [body_of([pairs[i % len(pairs)]]) for i in range(n)], None, c, rounds)
            results[str(c)] = {"requests_per_round": n, **stats}
            if ref:
                results[str(c)]["ratio_requests_per_s_after_before"] = ratio(stats, "after", "before")
            print(f"server overhead, c={c}: " + ", ".join(
                f"{name} {s['server_overhead_cpu_ms_per_pair']:.2f} ms CPU/request, {s['pairs_per_s']['median']:.0f}"
                " requests/s" for name, s in stats.items()), flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.close()
    return results


def load_200(scorer, expected_of, rounds: int, ref: str | None) -> dict:
    sizes = [1 + i % 8 for i in range(200)]
    pairs = distinct_pairs(sum(sizes), seed=3)
    bounds = [sum(sizes[:i]) for i in range(201)]
    chunks = [pairs[bounds[i] : bounds[i + 1]] for i in range(200)]
    servers = {"after": start_server("new", scorer, ref)}
    if ref:
        servers["before"] = start_server("old", scorer, ref)
    try:
        stats = run_rounds(servers, [body_of(chunk) for chunk in chunks],
                           [[expected_of[p] for p in chunk] for chunk in chunks], 200, rounds)  # fmt: skip
    finally:
        for server in servers.values():
            server.close()
    result = {"pairs": len(pairs), "requests": 200, **stats}
    if ref:
        result["ratio_after_before"] = ratio(stats, "after", "before")
    print(f"load 200 x 1..8 pairs ({len(pairs)} pairs): " + ", ".join(
        f"{name} {s['pairs_per_s']['median']:.0f} pairs/s" for name, s in stats.items()))  # fmt: skip
    return result


# ------------------------------------------------------------------------------------------------------ hostile
def serve_in_process(kind: str, rm_dir: str, ref: str | None, max_batch_size: int | None = None) -> None:
    """``--serve``: run one server until killed, printing ``URL <url>``."""
    from rlhf_ext.runtime.token_scores import SegmentScorer

    settings = {"max_batch_size": max_batch_size} if max_batch_size else {}
    server = start_server(kind, SegmentScorer(rm_dir), ref, **settings)
    print(f"URL {server.url}", flush=True)
    threading.Event().wait()


def rss_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def timed_get(url: str, timeout: float) -> float | None:
    """Seconds /health took, or None without an answer within ``timeout``."""
    import urllib.request

    started = time.perf_counter()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as answer:
            answer.read()
    except OSError:
        return None
    return time.perf_counter() - started


def hostile(kind: str, rm_dir: str, ref: str, flood_mb: int) -> dict:
    proc = ServerProcess(kind, rm_dir, ref)
    url = proc.url
    host, port = url.removeprefix("http://").split(":")
    address = (host, int(port))
    out: dict = {}
    try:
        timed_get(url, 60)
        # chunk size -1, then flood_mb MB, then the end of the stream
        before = rss_mb(proc.pid)
        sock = socket.create_connection(address)
        sock.sendall(request_head(address, chunked=True) + b"-1\r\n")
        started, sent = time.perf_counter(), 0
        try:
            for _ in range(flood_mb):
                sock.sendall(b"x" * (1 << 20))
                sent += 1 << 20
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed the connection
        answer = read_answer(sock, timeout=60)
        sock.close()
        out["chunk_minus_one"] = {"flood_mb": flood_mb, "accepted_mb": sent / 2**20, "answer": answer,
                                  "seconds": time.perf_counter() - started, "rss_before_mb": before,
                                  "rss_after_mb": rss_mb(proc.pid)}  # fmt: skip
        # 16 clients sending one byte every 2 s
        before = rss_mb(proc.pid)
        data = request_head(address, 10_000) + b" " * 10_000
        slow = [Trickler(address, data, interval=2.0) for _ in range(16)]
        for client in slow:
            client.start()
        time.sleep(3)
        health = timed_get(url, 30)
        started = time.perf_counter()
        try:
            status, _ = read_answer_of_post(address, body_of(distinct_pairs(1, seed=9)), 30)
            scored = time.perf_counter() - started if status == 200 else None
        except (OSError, TypeError):
            scored = None
        out["slowloris_16"] = {"health_s": health, "score_s": scored, "rss_before_mb": before,
                               "rss_after_mb": rss_mb(proc.pid)}  # fmt: skip
        for client in slow:
            client.stop()
        # 500 stalled connections
        stalled = [socket.create_connection(address) for _ in range(500)]
        for sock in stalled:
            sock.sendall(b"POST /get_reward HTTP/1.1\r\n")
        time.sleep(1)
        out["stalled_500"] = {"health_s": timed_get(url, 60), "rss_mb": rss_mb(proc.pid)}
        for sock in stalled:
            sock.close()
        time.sleep(1)
        # /health while 500 scoring requests of 8 pairs are in flight
        out["scoring_500"] = asyncio.run(health_under_load(url, body_of(distinct_pairs(8, seed=10)), 500))
    finally:
        proc.close()
    print(f"{kind}: {json.dumps(out)}", flush=True)
    return out


def read_answer_of_post(address, body: bytes, timeout: float):
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(request_head(address, len(body)) + body)
        return read_answer(sock, timeout)


async def health_under_load(url: str, body: bytes, n: int) -> dict:
    loop = asyncio.get_running_loop()
    load = asyncio.ensure_future(fire(f"{url}/get_reward", [body] * n, n))
    await asyncio.sleep(0.5)
    probes = []
    for _ in range(5):
        probes.append(await loop.run_in_executor(None, timed_get, url, 60))
        await asyncio.sleep(0.2)
    wall, _, _ = await load
    answered = [p for p in probes if p is not None]
    return {"health_s": probes, "health_median_s": statistics.median(answered) if answered else None,
            "load_wall_s": wall, "pairs": 8 * n}  # fmt: skip


# --------------------------------------------------------------------------------------------------------- main
def summary_rows(concurrency: dict, processes: bool) -> list[dict]:
    """``make bench``'s rows: batched over per-request pairs/s at c = 1 (target >= 1.0x) and c = 64 (>= 3x)."""
    where = ", each server in its own process" if processes else ""
    probe = machine_probe()

    def text(stats: dict, what: str) -> str:
        lat = stats["latency_ms"]
        return (f"{what} {stats['pairs_per_s']['median']:.0f} pairs/s, latency p50 {lat['p50']:.1f} ms, "
                f"p99 {lat['p99']:.1f} ms")  # fmt: skip

    return [summary_row(f"serve rm vs per-request scoring at concurrency {c}{where}",
                        text(concurrency[str(c)]["batched"], "batched server"),
                        text(concurrency[str(c)]["per_request"], "per-request scoring (max_batch_size=1)"),
                        concurrency[str(c)]["ratio_batched_per_request"], target, probe, unit="x pairs/s")
            for c, target in ((1, ">= 1.0x"), (64, ">= 3x")) if str(c) in concurrency]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default benchmarks/results/serve_rm.json (--quick: *_quick.json)")
    parser.add_argument("--model", default="builtin:tiny-segment-rm")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds per table (after one warm-up)")
    parser.add_argument("--levels", default="1,8,64", help="concurrency levels")
    parser.add_argument("--before", default=None, help="git ref of the old server (rlhf_ext/pipelines/serve_rm.py)")
    parser.add_argument("--hostile", action="store_true", help="the hostile-client figures (needs --before)")
    parser.add_argument("--flood-mb", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="only table 1, at c = 1 and 64, 9 rounds")
    parser.add_argument("--processes", action="store_true", help="table 1's servers each in its own process")
    parser.add_argument("--serve", choices=["new", "old"], help=argparse.SUPPRESS)
    parser.add_argument("--max-batch-size", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.levels = 9, "1,64"
    if args.processes and (args.before or args.hostile):
        parser.error("--processes measures table 1 of this tree's server only; drop --before / --hostile")
    name = "serve_rm" + ("_quick" if args.quick else "") + ("_processes" if args.processes else "")
    args.out = args.out or str(REPO / f"benchmarks/results/{name}.json")
    torch.set_num_threads(1)
    from rlhf_ext.pipelines.builtins import resolve_model

    rm_dir = resolve_model(args.model)
    if args.serve:
        return serve_in_process(args.serve, rm_dir, args.before, args.max_batch_size)
    from rlhf_ext.runtime.token_scores import SegmentScorer

    scorer = SegmentScorer(rm_dir)
    levels = [int(c) for c in args.levels.split(",")]
    pairs = distinct_pairs(max(map(requests_at, levels)), seed=11)
    expected = [scorer.score(p, r).evaluation for p, r in pairs]
    alone = per_pair_in_process(scorer, pairs[:36])
    print(f"in process, one pair alone (tokenise + SFT and RM forwards): {1e3 * alone:.2f} ms", flush=True)
    results = {
        "setting": {
            "model": args.model,
            "rounds": args.rounds,
            "torch_threads": 1,
            "pairs_per_request": 1,
            "machine_note": "2 CPU cores shared with other jobs: read the ratios, not the absolute rates",
            "before": args.before,
            "quick": args.quick,
            "servers": "each in its own process, the client in this one" if args.processes else "in this process",
        },  # fmt: skip
        "in_process_ms_per_pair_alone": 1e3 * alone,
        "concurrency": concurrency_table(
            scorer, pairs, expected, args.rounds, levels, args.before, rm_dir if args.processes else None
        ),  # fmt: skip
    }
    results["summary"] = summary_rows(results["concurrency"], args.processes)
    if not args.quick and not args.processes:  # tables 2 and 3 need the server in this process
        load_pairs = distinct_pairs(900, seed=3)
        expected_of = dict(zip(load_pairs, (scorer.score(p, r).evaluation for p, r in load_pairs)))
        results["server_overhead"] = overhead_table(scorer, pairs, args.rounds, args.before)
        results["load_200"] = load_200(scorer, expected_of, args.rounds, args.before)
    one = results["concurrency"].get("1")
    if one:  # latency of a lone one-pair request beyond the same work done in process
        results["server_latency_overhead_ms_at_c1"] = one["batched"]["latency_ms"]["p50"] - 1e3 * alone
    if args.hostile:
        if not args.before:
            parser.error("--hostile needs --before REF (the old server to compare with)")
        results["hostile"] = {kind: hostile(kind, rm_dir, args.before, args.flood_mb) for kind in ("old", "new")}
    results["machine"] = machine_info()
    atomic_write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
