"""Span-to-token mapping throughput: :func:`rlhf_ext.algos.spans.dense_span_rewards` (vectorised over the batch) against
the per-sample Python loop (:func:`tests.helpers.reference.reference_span_rewards`, the tests' oracle, handed Python
lists so that it pays no tensor conversion). Never part of the tests.

B=64 responses of T=1024 tokens (1-6 characters each), each response's text cut into contiguous spans of 4-28 tokens
(about 64 per response, as a segment reward model's segments). One process, one thread, CPU time
(``time.process_time``), both sides interleaved, medians; the outputs are checked equal before timing.

    python benchmarks/spans.py [--out benchmarks/results/spans.json] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers

from rlhf_ext.algos.spans import dense_span_rewards  # noqa: E402
from rlhf_ext.runtime.io import atomic_write_json, machine_info  # noqa: E402
from tests.helpers.reference import reference_span_rewards  # noqa: E402


def make_case(b: int, t: int, seed: int = 0):
    """``(tensors for dense_span_rewards, spans, offsets)``: random token widths, contiguous spans of 4-28 tokens."""
    g = torch.Generator().manual_seed(seed)
    widths = torch.randint(1, 7, (b, t), generator=g)
    token_end = widths.cumsum(dim=1)
    token_start = token_end - widths
    offsets = [list(zip(s.tolist(), e.tolist())) for s, e in zip(token_start, token_end)]
    spans = []
    for row in range(b):
        cuts, pos = [0], 0
        while pos < t:
            pos = min(t, pos + int(torch.randint(4, 29, (1,), generator=g)))
            cuts.append(pos)
        chars = [0, *token_end[row].tolist()]
        rewards = torch.randn(len(cuts) - 1, generator=g).tolist()
        spans.append([(chars[a], chars[c], r) for a, c, r in zip(cuts[:-1], cuts[1:], rewards)])
    k = max(map(len, spans))
    start = torch.zeros(b, k, dtype=torch.long)
    end = torch.zeros(b, k, dtype=torch.long)
    reward = torch.zeros(b, k)
    for i, row in enumerate(spans):
        start[i, : len(row)] = torch.tensor([a for a, _, _ in row])
        end[i, : len(row)] = torch.tensor([c for _, c, _ in row])
        reward[i, : len(row)] = torch.tensor([r for _, _, r in row])
    mask = torch.ones(b, t, dtype=torch.bool)
    return (start, end, reward, token_start, token_end, mask), spans, offsets


def cpu_times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/spans.json")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tensors, spans, offsets = make_case(args.batch, args.tokens)
    n_spans = sum(map(len, spans))
    vectorised = dense_span_rewards(*tensors).rewards
    loop = torch.tensor(reference_span_rewards(spans, offsets))
    torch.testing.assert_close(vectorised, loop)  # the same rewards before timing them
    vec_t, loop_t = [], []
    for _ in range(args.repeats):  # interleaved
        vec_t += cpu_times(lambda: dense_span_rewards(*tensors), 1)
        loop_t += cpu_times(lambda: reference_span_rewards(spans, offsets), 1)
    v, r = statistics.median(vec_t), statistics.median(loop_t)
    result = {
        "batch": args.batch, "tokens": args.tokens, "spans": n_spans, "repeats": args.repeats, "threads": 1,
        "clock": "process_time (CPU seconds)",
        "vectorised_s": v, "per_sample_loop_s": r,
        "vectorised_spans_per_s": n_spans / v, "per_sample_loop_spans_per_s": n_spans / r, "speedup": r / v,
        "machine": machine_info(),
    }  # fmt: skip
    print(f"B={args.batch} T={args.tokens}: {n_spans} spans, 1 thread, CPU time, median of {args.repeats}")
    print(f"{'path':<22}{'CPU s':>10}{'spans/s':>14}")
    print(f"{'vectorised':<22}{v:>10.4f}{n_spans / v:>14,.0f}")
    print(f"{'per-sample loop':<22}{r:>10.4f}{n_spans / r:>14,.0f}")
    print(f"speedup: {r / v:.1f}x")
    if args.out:
        atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
