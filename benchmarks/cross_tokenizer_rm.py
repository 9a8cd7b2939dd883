"""Held-out pair accuracy of a segment reward model on another tokenizer than the policy's (issue 27, source (c)).

Two arms, trained per seed with ``recipes/segment_rm_tiny.yaml`` through the package's own pipeline
(:func:`~rlhf_ext.pipelines.segment_rm.run_segment_rm`: TRL's ``SegmentRewardTrainer``) on ``builtin:toy-keyphrase``
(train split; held out: its test split), identical settings (entropy cutoff 2.0, soft-max, tau 0.5, 1 epoch,
lr 1e-3, batch 16, max_length 128):

* (a) same tokenizer: the toy policy's 512-token BPE, ``builtin:tiny-sft`` as SFT model (the standard path);
* (b) other tokenizer: GPT-2's byte-level BPE: a tiny model on it, fine-tuned by the same routine and data as
  ``builtin:tiny-sft`` (:func:`~rlhf_ext.pipelines.builtins.train_tiny_sft`, same seed and steps), then the RM.

For (b) it also scores the held-out pairs as the policy side sees them: :class:`~rlhf_ext.runtime.dense_sources.
SegmentRewardSpans` (spans over the response text) mapped onto the TOY policy's tokens by
:func:`~rlhf_ext.runtime.spans.dense_rewards` (segment granularity, even split, no normaliser), and compares chosen
vs rejected by (c) the sum of the mapped per-token rewards. With soft-max aggregation a response's score e_phi
(Eq. 4, what (a)/(b) accuracy compares) is a weighted mean of its segment rewards, not their sum, so (c) is checked
against the accuracy of the RM's own segment-reward sums (before mapping; equal if the mapping keeps totals), and
SegmentRewardSpans' e_phi against the trainer's accuracy (the same model read by two paths).

    python benchmarks/cross_tokenizer_rm.py [--seeds 0 1 2] [--train-pairs N] [--sft-dir DIR] [--out ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RECIPE = Path(__file__).resolve().parents[1] / "rlhf_ext" / "recipes" / "segment_rm_tiny.yaml"


def gpt2_sft(dest: Path) -> str:
    """``builtin:tiny-sft``'s recipe on GPT-2's tokenizer, built once into ``dest``: the tiny model (seed 0, as
    ``builtin:tiny``) fine-tuned by the same routine on the same data (:func:`train_tiny_sft`)."""
    from rlhf_ext.pipelines.builtins import train_tiny_sft
    from rlhf_ext.runtime.io import build_once
    from rlhf_ext.zoo.models import save_tiny_checkpoint
    from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

    def build(path: Path) -> None:
        base = save_tiny_checkpoint(path.with_name(path.name + "-base"), tokenizer=gpt2_tokenizer(), seed=0)
        train_tiny_sft(path, base)

    return str(build_once(dest, build, "config.json"))


def train_rm(sft: str, out: Path, seed: int, train_pairs: int | None) -> dict:
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe, run_segment_rm

    overrides = [f"model.sft_model={sft}", f"train.output_dir={out}", f"train.seed={seed}", "train.logging_steps=1000"]
    if train_pairs is not None:
        overrides.append(f"data.max_train_samples={train_pairs}")
    return run_segment_rm(load_recipe(SegmentRMRecipe, RECIPE, overrides))


def policy_side_accuracy(rm_dir: str, test, max_length: int, batch_size: int = 32) -> dict:
    """(b) read as a dense source for the toy policy: per pair, chosen vs rejected by e_phi (SegmentRewardSpans),
    by the sum of the RM's segment rewards, and by the sum of those rewards mapped onto the toy policy's tokens."""
    import torch

    from rlhf_ext.runtime.dense_sources import SegmentRewardSpans
    from rlhf_ext.runtime.segment_data import pad_sequences
    from rlhf_ext.runtime.spans import dense_rewards, parse_outputs
    from rlhf_ext.zoo.builtins import toy_tokenizer

    source = SegmentRewardSpans(rm_dir, device="cpu", max_length=max_length, batch_size=batch_size)
    policy_tok = toy_tokenizer()
    rows = list(test)
    values, span_sums, mapped_sums, worst, not_round_trip = [], [], [], 0.0, 0
    for side in ("chosen", "rejected"):
        for begin in range(0, len(rows), batch_size):
            batch = rows[begin : begin + batch_size]
            encoded = [source.encode(r["prompt"], r[side]) for r in batch]
            e_phi, spans = source.score(encoded)
            ids = [policy_tok(e.text, add_special_tokens=False)["input_ids"] for e in encoded]
            not_round_trip += sum(policy_tok.decode(i) != e.text for i, e in zip(ids, encoded))
            completion_ids = pad_sequences(ids, 0, "right", torch.long)
            mask = pad_sequences([[1] * len(i) for i in ids], 0, "right", torch.long).bool()
            out = parse_outputs("segment_rm", spans, len(batch))
            mapped = dense_rewards([out], [1.0], policy_tok, completion_ids, mask).sequence_reward
            sums = torch.tensor(out.totals())
            worst = max(worst, float((mapped - sums).abs().max()))
            values += e_phi
            span_sums += sums.tolist()
            mapped_sums += mapped.tolist()
    n = len(rows)

    def acc(scores: list[float]) -> float:
        return sum(c > r for c, r in zip(scores[:n], scores[n:])) / n

    return {
        "acc_e_phi_spans_path": acc(values),
        "acc_rm_segment_sum": acc(span_sums),
        "acc_policy_mapped_sum": acc(mapped_sums),
        "max_abs_total_diff": worst,
        "responses_not_round_tripping_policy_tokenizer": not_round_trip,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-pairs", type=int, default=None, help="Cap on training pairs (default: all 512).")
    parser.add_argument("--out", default="benchmarks/results/cross_tokenizer_rm.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sft-dir", default=None, help="Where the GPT-2-tokenizer SFT model is built once and reused "
                        "(default: a temporary directory, rebuilt every run: ~10 min on 2 shared cores).")  # fmt: skip
    args = parser.parse_args()

    import torch

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.io import atomic_write_json
    from rlhf_ext.zoo.builtins import resolve_dataset

    torch.set_num_threads(args.threads)
    test = resolve_dataset("builtin:toy-keyphrase")["test"]
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        sft_b = gpt2_sft(Path(args.sft_dir) if args.sft_dir else root / "gpt2-tiny-sft")
        arms = {"a_same_tokenizer": resolve_model("builtin:tiny-sft"), "b_gpt2_tokenizer": sft_b}
        print(f"GPT-2-tokenizer SFT model ready in {time.perf_counter() - started:.0f} s: {sft_b}", flush=True)
        for seed in args.seeds:
            row: dict = {"seed": seed}
            for arm, sft in arms.items():
                started = time.perf_counter()
                summary = train_rm(sft, root / f"{arm}-{seed}", seed, args.train_pairs)
                row[arm] = {
                    "accuracy": summary["eval"]["eval_accuracy"],
                    "segments_per_response": summary["eval"]["eval_segments_per_response"],
                    "seconds": round(time.perf_counter() - started, 1),
                }
            row["c_policy_side"] = policy_side_accuracy(root / f"b_gpt2_tokenizer-{seed}", test, 128)
            results.append(row)
            print(f"seed {seed}: {row}", flush=True)
            atomic_write_json(Path(args.out), {"train_pairs": args.train_pairs, "results": results})  # so far

    def column(path: tuple[str, str]) -> list[float]:
        return [r[path[0]][path[1]] for r in results]

    columns = {
        "(a) same tokenizer acc": ("a_same_tokenizer", "accuracy"),
        "(b) GPT-2 tokenizer acc": ("b_gpt2_tokenizer", "accuracy"),
        "(a) segments/response": ("a_same_tokenizer", "segments_per_response"),
        "(b) segments/response": ("b_gpt2_tokenizer", "segments_per_response"),
        "(b) e_phi acc via spans path": ("c_policy_side", "acc_e_phi_spans_path"),
        "(b) segment-sum acc, RM tokens": ("c_policy_side", "acc_rm_segment_sum"),
        "(c) mapped-sum acc, toy tokens": ("c_policy_side", "acc_policy_mapped_sum"),
    }
    summary = {}
    print(f"\nHeld-out pairs: {len(test)}; seeds {args.seeds}; train pairs {args.train_pairs or 'all (512)'}")
    for name, path in columns.items():
        values = column(path)
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        summary[name] = {"mean": statistics.mean(values), "stdev": spread, "min": min(values), "max": max(values)}
        cells = "  ".join(f"{v:7.3f}" for v in values)
        print(f"{name:32s} {cells}   mean {statistics.mean(values):.3f} (sd {spread:.3f})")
    worst = max(r["c_policy_side"]["max_abs_total_diff"] for r in results)
    print(f"largest |mapped total - segment total| over responses: {worst:.2e}")
    atomic_write_json(Path(args.out), {"train_pairs": args.train_pairs, "results": results, "summary": summary})


if __name__ == "__main__":
    main()
