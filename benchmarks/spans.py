"""Span-to-token mapping throughput: :func:`rlhf_ext.algos.spans.dense_span_rewards` (vectorised over the batch) against
the per-sample Python loop (:func:`tests.helpers.reference.reference_span_rewards`, the tests' oracle, handed Python
lists so that it pays no tensor conversion). Never part of the tests.

B=64 responses of T=1024 tokens (1-6 characters each), each response's text cut into contiguous spans of 4-28 tokens
(about 64 per response, as a segment reward model's segments). One process, one thread, CPU time
(``time.process_time``), both sides interleaved, medians; the outputs are checked equal before timing.

``--offsets``: the step before it, the policy tokens' character offsets
(:func:`rlhf_ext.runtime.spans.completion_offsets`, batched from byte lengths) against the row-by-row streaming
decoder (:func:`rlhf_ext.runtime.spans.offsets_by_row`), on GPT-2's tokenizer: B=64 completions of up to T=1024 tokens
of English with accented letters, CJK and emoji, EOS-terminated and right-padded (cut at a token count, so some rows
end inside a character, as a completion cut at its length limit does), timed on all rows and on the rows that end on
a whole character (the streaming decoder's own case; the others took its one-decode-per-token fallback).

    python benchmarks/spans.py [--offsets] [--out benchmarks/results/spans.json] [--repeats 7]
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


def offsets_case(b: int, t: int, seed: int = 0):
    """``(tokenizer, completion_ids [B, T], mask [B, T])``: GPT-2 tokens of random words, 1/2 to all of ``t`` each."""
    from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    g = torch.Generator().manual_seed(seed)
    words = [
        "the",
        "a",
        "reward",
        "model",
        "is",
        "trained",
        "on",
        "pairs",
        "café",
        "naïve",
        "résumé",
        "日本語",
        "☕",
        "🙂",
        "—",
        "“quoted”",
        "1,024",
        "steps\n",
    ]
    ids = torch.full((b, t), tok.pad_token_id)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for row in range(b):
        n = int(torch.randint(t // 2, t + 1, (1,), generator=g))
        text = " ".join(words[i] for i in torch.randint(0, len(words), (t,), generator=g).tolist())
        tokens = tok(text, add_special_tokens=False)["input_ids"][: n - 1] + [tok.eos_token_id]
        ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), True
    return tok, ids, mask


def spread(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def time_offsets(tok, ids: torch.Tensor, mask: torch.Tensor, repeats: int) -> dict:
    """Both paths on one batch, interleaved: their CPU seconds (median, min, max) and the ratio of the medians."""
    from rlhf_ext.runtime.spans import completion_offsets, offsets_by_row

    def by_row():  # the old completion_offsets: each row decoded and streamed in token_char_offsets
        starts, ends = torch.zeros_like(ids), torch.zeros_like(ids)
        offsets_by_row(tok, ids, mask, starts, ends, range(len(ids)))
        return starts, ends

    _, starts, ends = completion_offsets(tok, ids, mask)  # builds the tokenizer's byte table once, before timing
    expected = by_row()
    assert torch.equal(starts, expected[0]) and torch.equal(ends, expected[1])  # the same offsets before timing
    batch_t, row_t = [], []
    for _ in range(repeats):  # interleaved
        batch_t += cpu_times(lambda: completion_offsets(tok, ids, mask), 1)
        row_t += cpu_times(by_row, 1)
    speedup = statistics.median(row_t) / statistics.median(batch_t)
    return {"rows": len(ids), "completion_tokens": int(mask.sum()), "batched": spread(batch_t),
            "by_row_stream": spread(row_t), "speedup": speedup}  # fmt: skip


def offsets_main(args) -> dict:
    tok, ids, mask = offsets_case(args.batch, args.tokens)
    texts = tok.batch_decode([r[m].tolist() for r, m in zip(ids, mask)], skip_special_tokens=True)
    whole = torch.tensor(["\ufffd" not in t for t in texts])  # the rest end inside a character (cut by the limit)
    cases = {"all rows": time_offsets(tok, ids, mask, args.repeats),
             "rows of whole characters": time_offsets(tok, ids[whole], mask[whole], args.repeats)}  # fmt: skip
    result = {
        "batch": args.batch, "tokens": args.tokens, "tokenizer": "gpt2", "repeats": args.repeats, "threads": 1,
        "clock": "process_time (CPU seconds)", **cases["all rows"], "whole_character_rows": cases[
        "rows of whole characters"], "machine": machine_info(),
    }  # fmt: skip
    print(f"completion_offsets, GPT-2 tokenizer, B={args.batch} T<={args.tokens}, 1 thread, CPU time, "
          f"{args.repeats} repeats; {int((~whole).sum())} rows end inside a character")  # fmt: skip
    print(f"{'rows':<32}{'path':<18}{'median s':>10}{'min s':>10}{'max s':>10}{'tokens/s':>14}")
    for case, r in cases.items():
        label = f"{case} ({r['rows']})"
        for name, key in (("batched (bytes)", "batched"), ("by row (stream)", "by_row_stream")):
            t = r[key]
            print(f"{label:<32}{name:<18}{t['median_s']:>10.4f}{t['min_s']:>10.4f}{t['max_s']:>10.4f}"
                  f"{r['completion_tokens'] / t['median_s']:>14,.0f}")  # fmt: skip
        print(f"{case}: speedup {r['speedup']:.1f}x")
    if args.out:
        atomic_write_json(args.out, result)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offsets", action="store_true", help="time the tokens' character offsets instead")
    parser.add_argument(
        "--out", default=None, help="JSON (default benchmarks/results/spans.json, or spans_offsets.json with --offsets)"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.offsets:
        args.out = "benchmarks/results/spans_offsets.json" if args.out is None else args.out
        return offsets_main(args)
    args.out = "benchmarks/results/spans.json" if args.out is None else args.out
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
