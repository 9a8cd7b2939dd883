"""Segmentation speed and segment-RM step cost (paper 003). Prints a table and writes JSON; never part of the tests.

1. Segmentation + gather for B=64, T=1024: the vectorised path (``segment_boundaries`` -> ``segment_ids`` ->
   ``gather_segment_rewards``) against two per-sample Python loops: the straightforward one that walks each
   sample's tensors token by token, and a tuned one that converts to Python lists first
   (:func:`tests.helpers.reference.reference_segment_rewards`, the tests' oracle). Target: >= 50x.
2. One reward-model training step (forward + loss + backward) of ``SegmentRewardTrainer`` (c_ent = 2.0) against TRL's
   stock ``RewardTrainer`` (bandit) on the same batch and weights, entropy preprocessing excluded. Target: <= 1.10x.
   Measured for the tiny test model and for the SmolLM2-135M architecture (random weights, built from config).

Each comparison runs both sides interleaved in one process and reports medians.

    python benchmarks/segmentation.py [--out benchmarks/results/segmentation.json] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhf_ext.runtime.io import atomic_write_json, machine_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_segmentation(b: int, t: int, repeats: int) -> dict:
    from rlhf_ext.segment import gather_segment_rewards, segment_boundaries, segment_ids
    from tests.helpers.reference import reference_segment_rewards

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, 256, (b, 1), generator=g)
    resp = torch.randint(t // 4, t - 256, (b, 1), generator=g)
    pos = torch.arange(t).unsqueeze(0)
    action = (pos >= prompt) & (pos < prompt + resp)
    entropy = torch.rand(b, t, generator=g) * 4  # ~half the tokens above a cutoff of 2.0
    scores = torch.randn(b, t, generator=g)

    def vectorised():
        seg = segment_ids(segment_boundaries(entropy, action, 2.0), action)
        return gather_segment_rewards(scores, seg)

    def loop():
        return reference_segment_rewards(scores, entropy, action, 2.0)

    def tensor_loop():  # the straightforward per-sample, per-token loop over tensors
        out = []
        for i in range(b):
            segs, start = [], None
            for j in range(t):
                if not action[i, j]:
                    if start is not None:
                        segs.append(float(scores[i, j - 1]))
                        start = None
                elif start is None:
                    start = j
                elif entropy[i, j] > 2.0:
                    segs.append(float(scores[i, j - 1]))
                    start = j
            if start is not None:
                segs.append(float(scores[i, t - 1]))
            out.append(segs)
        return out

    # same answer first
    rewards = vectorised()
    ref = loop()
    for row, segs in enumerate(ref):
        got = rewards[row, : len(segs)].tolist()
        assert got == [r for *_, r in segs], "vectorised and loop disagree"
    assert tensor_loop() == [[r for *_, r in segs] for segs in ref]
    vec, ref_t, naive_t = [], [], []
    for i in range(repeats):  # interleaved
        vec += timed(vectorised, 5)
        ref_t += timed(loop, 1)
        if i < 3:
            naive_t += timed(tensor_loop, 1)
    v, r, n = statistics.median(vec), statistics.median(ref_t), statistics.median(naive_t)
    return {
        "B": b,
        "T": t,
        "vectorised_ms": v * 1e3,
        "tensor_loop_ms": n * 1e3,
        "list_loop_ms": r * 1e3,
        "speedup_vs_tensor_loop": n / v,
        "speedup_vs_list_loop": r / v,
    }


def _prepared_batch(tokenizer, n_pairs: int, max_len: int):
    from datasets import Dataset

    from rlhf_ext.runtime.segment_data import tokenize_preference_dataset
    from rlhf_ext.zoo.toy import toy_preference_rows

    rows = toy_preference_rows(n_pairs, seed=3)
    words = " ".join(r["chosen"] for r in rows)  # long responses so T ~ max_len
    long_rows = [
        {
            "prompt": r["prompt"],
            "chosen": (r["chosen"] + words)[: max_len * 3],
            "rejected": (r["rejected"] + words)[: max_len * 3],
        }
        for r in rows
    ]
    tok = tokenize_preference_dataset(Dataset.from_list(long_rows), tokenizer, max_length=max_len)
    g = torch.Generator().manual_seed(1)

    def add_entropy(row):  # entropy preprocessing is excluded from the timing: synthetic values suffice
        n_c = len(row["chosen_ids"]) - row["prompt_len"]
        n_r = len(row["rejected_ids"]) - row["prompt_len"]
        return {
            "chosen_entropy": (torch.rand(n_c, generator=g) * 4).tolist(),
            "rejected_entropy": (torch.rand(n_r, generator=g) * 4).tolist(),
        }

    return tok.map(add_entropy)


def bench_step(label: str, model_dir: str, n_pairs: int, max_len: int, repeats: int) -> dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    from rlhf_ext.trl import SegmentPreferenceCollator, SegmentRewardConfig, SegmentRewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = _prepared_batch(tokenizer, n_pairs, max_len)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    common = dict(bf16=False, use_cpu=True, report_to="none", gradient_checkpointing=False, disable_tqdm=True)
    with tempfile.TemporaryDirectory() as tmp:
        seg = SegmentRewardTrainer(
            model=model,
            args=SegmentRewardConfig(output_dir=tmp, entropy_cutoff=2.0, max_length=None, **common),
            train_dataset=data,
            processing_class=tokenizer,
        )
        stock = RewardTrainer(
            model=model,
            args=RewardConfig(output_dir=tmp, max_length=None, **common),
            train_dataset=data.select_columns(["chosen_ids", "rejected_ids"]),
            processing_class=tokenizer,
        )
    examples = [data[i] for i in range(n_pairs)]
    seg_batch = SegmentPreferenceCollator(tokenizer.pad_token_id)(examples)
    stock_batch = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)(
        [{"chosen_ids": e["chosen_ids"], "rejected_ids": e["rejected_ids"]} for e in examples]
    )
    model.train()

    def step(trainer, batch):
        def run():
            loss = trainer.compute_loss(model, dict(batch))
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    seg_run, stock_run = step(seg, seg_batch), step(stock, stock_batch)
    seg_run(), stock_run()  # warm up
    seg_t, stock_t = [], []
    for _ in range(repeats):
        stock_t += timed(stock_run, 1)
        seg_t += timed(seg_run, 1)
    s, b = statistics.median(seg_t), statistics.median(stock_t)
    return {
        "model": label,
        "pairs": n_pairs,
        "T": int(seg_batch["input_ids"].shape[1]),
        "bandit_step_ms": b * 1e3,
        "segment_step_ms": s * 1e3,
        "ratio": s / b,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/segmentation.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, small model only")
    args = parser.parse_args()
    torch.manual_seed(0)
    repeats = 3 if args.quick else 7

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.zoo.models import tiny_config

    results = {"segmentation": bench_segmentation(64, 1024, repeats)}
    steps = [bench_step("tiny (2 layers, hidden 64)", resolve_model("builtin:tiny"), 8, 256, repeats * 2)]
    if not args.quick:
        from transformers import AutoConfig, AutoModelForCausalLM

        smol = resolve_model("builtin:smollm2")
        with tempfile.TemporaryDirectory() as tmp:  # SmolLM2-135M architecture, random weights
            cfg = AutoConfig.from_pretrained(smol)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(smol).save_pretrained(tmp)
            steps.append(bench_step("SmolLM2-135M architecture", tmp, 8, 256, repeats))
    del tiny_config
    results["step"] = steps
    results["machine"] = machine_info()

    s = results["segmentation"]
    print(f"\nSegmentation + gather, B={s['B']}, T={s['T']} (median of {repeats})")
    print(f"{'implementation':34s} {'ms':>9} {'vectorised speed-up':>20}   target >= 50x")
    print(f"{'vectorised (rlhf_ext.segment)':34s} {s['vectorised_ms']:9.2f}")
    print(f"{'per-sample loop over tensors':34s} {s['tensor_loop_ms']:9.1f} {s['speedup_vs_tensor_loop']:19.0f}x")
    print(f"{'per-sample loop over Python lists':34s} {s['list_loop_ms']:9.1f} {s['speedup_vs_list_loop']:19.0f}x")
    print("\nReward-model training step (forward + loss + backward), same batch and weights")
    print(
        f"{'model':28s} {'pairs':>5} {'T':>5} {'bandit (ms)':>12} {'segment (ms)':>13} {'ratio':>6}   target <= 1.10x"
    )
    for r in results["step"]:
        print(f"{r['model']:28s} {r['pairs']:5d} {r['T']:5d} {r['bandit_step_ms']:12.1f} {r['segment_step_ms']:13.1f} "
              f"{r['ratio']:6.3f}")  # fmt: skip
    out = Path(args.out)
    atomic_write_json(out, results)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
