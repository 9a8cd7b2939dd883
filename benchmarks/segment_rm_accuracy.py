"""Held-out accuracy of bandit, token and segment reward models on the toy key-phrase task (paper 003, Table 1).

The three models differ only in the entropy cutoff (Appendix C): ``inf`` = bandit, ``0`` = token, ``2.0`` = segment.
All use soft-max aggregation (tau 0.5), the same SFT model (``builtin:tiny-sft``), the same segmented data and the
same seeds; budgets are small on purpose so that the settings can differ (with a full epoch on 512 pairs all three
reach 100%). Prints mean +- standard error over seeds and writes JSON.

    python benchmarks/segment_rm_accuracy.py [--seeds 0 1 2] [--train-pairs 64 128] [--out ...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from pathlib import Path

from rlhf_ext.runtime.io import atomic_write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

SETTINGS = {"bandit (c=inf)": math.inf, "token (c=0)": 0.0, "segment (c=2.0)": 2.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-pairs", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--test-pairs", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/segment_rm_accuracy.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.segment_data import prepare_segment_dataset
    from rlhf_ext.trl import SegmentRewardConfig, SegmentRewardTrainer
    from rlhf_ext.zoo.toy import toy_preference_dataset

    sft = resolve_model("builtin:tiny-sft")
    tok = AutoTokenizer.from_pretrained(sft)
    data = toy_preference_dataset(n_train=max(args.train_pairs), n_test=args.test_pairs, seed=7)
    train_all = prepare_segment_dataset(data["train"], tok, sft_model_name_or_path=sft)
    test = prepare_segment_dataset(data["test"], tok, sft_model_name_or_path=sft)
    results: list[dict] = []
    for n in args.train_pairs:
        for name, cutoff in SETTINGS.items():
            for seed in args.seeds:
                with tempfile.TemporaryDirectory() as tmp:
                    cfg = SegmentRewardConfig(
                        output_dir=tmp, entropy_cutoff=cutoff, num_train_epochs=1, per_device_train_batch_size=8,
                        per_device_eval_batch_size=32, learning_rate=1e-3, lr_scheduler_type="cosine",
                        warmup_steps=0.1, seed=seed, bf16=False, use_cpu=True, report_to="none",
                        save_strategy="no", gradient_checkpointing=False, disable_tqdm=True, logging_steps=1000,
                    )  # fmt: skip
                    train = train_all.shuffle(seed=seed).select(range(n))
                    trainer = SegmentRewardTrainer(
                        model=sft, args=cfg, train_dataset=train, eval_dataset=test, processing_class=tok
                    )
                    trainer.train()
                    metrics = trainer.evaluate()
                results.append(
                    {
                        "train_pairs": n,
                        "setting": name,
                        "seed": seed,
                        "accuracy": metrics["eval_accuracy"],
                        "segments_per_response": metrics["eval_segments_per_response"],
                    }
                )
                print(f"{n:4d} pairs  {name:16s} seed {seed}: acc {metrics['eval_accuracy']:.3f}", flush=True)

    def cell(rows: list[dict]) -> str:
        accs = [r["accuracy"] for r in rows]
        se = statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else 0.0
        return f"{statistics.mean(accs):.3f} +- {se:.3f}"

    print(f"\nHeld-out accuracy ({args.test_pairs} test pairs, mean +- s.e. over seeds {args.seeds})")
    print(f"{'train pairs':>11}  " + "  ".join(f"{k:>18}" for k in SETTINGS))
    for n in args.train_pairs:
        cells = [cell([r for r in results if r["train_pairs"] == n and r["setting"] == k]) for k in SETTINGS]
        print(f"{n:11d}  " + "  ".join(f"{c:>18}" for c in cells))
    segs = {k: statistics.mean(r["segments_per_response"] for r in results if r["setting"] == k) for k in SETTINGS}
    print("segments per response: " + ", ".join(f"{k} {v:.1f}" for k, v in segs.items()))
    out = Path(args.out)
    atomic_write_json(out, {"results": results, "segments_per_response": segs})


if __name__ == "__main__":
    main()
