"""Segment PPO costs (paper 003, section 2.3). Prints tables and writes JSON; never part of the tests.

1. Reward cost per PPO batch: producing dense segment rewards vs bandit rewards for the same batch with the same
   models. Both sides run the reference forward (log-probs for the KL term) and the reward-model forward; the
   segment side asks the reference forward for entropies too (TRL's fused head computes them from the same logits)
   and reads the reward head at every position, then segments / normalizes / interpolates. Target <= 1.05x.
2. Peak memory of tiny PPO training steps with the critic (GAE) and without it (REINFORCE), each in a fresh
   process: resident memory sampled every 2 ms during the steps, relative to just before them.
3. A short PPO run's reward / KL curve (``recipes/segment_ppo_tiny.yaml``).

    python benchmarks/segment_ppo.py [--out benchmarks/results/segment_ppo.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhf_ext.runtime.io import atomic_write_json, machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def reward_cost(label: str, policy_dir: str, rm_dir: str, batch: int, completion: int, repeats: int) -> dict:
    """Median wall-clock of bandit vs segment reward production for one rollout batch (interleaved)."""
    from entropy_fused import reward_trainer

    from rlhf_ext.runtime.token_scores import position_scores
    from rlhf_ext.segment import LocationNormalizer, dense_segment_rewards

    trainer = reward_trainer(policy_dir, rm_dir, batch, completion)
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    prompt = 32
    ids = torch.randint(0, vocab, (batch, prompt + completion), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.ones(batch, completion, dtype=torch.bool)
    norm = LocationNormalizer(kind="global", b_mu=0.1, b_sigma=0.2)

    @torch.no_grad()
    def bandit():
        trainer._get_per_token_logps_and_entropies(trainer.segment_ref_model, ids, attn, completion)
        scores = position_scores(trainer._reward_capture, trainer.reward_model, ids, attn)[:, -completion:]
        return dense_segment_rewards(scores, mask, normalizer=norm, granularity="bandit").rewards

    @torch.no_grad()
    def segment():
        _, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.segment_ref_model, ids, attn, completion, compute_entropy=True
        )
        scores = position_scores(trainer._reward_capture, trainer.reward_model, ids, attn)[:, -completion:]
        return dense_segment_rewards(scores, mask, ent, normalizer=norm, entropy_cutoff=2.0).rewards

    bandit(), segment()
    b_t, s_t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bandit()
        b_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        segment()
        s_t.append(time.perf_counter() - t0)
    b, s = statistics.median(b_t), statistics.median(s_t)
    return {"models": label, "batch": batch, "completion": completion, "bandit_ms": b * 1e3, "segment_ms": s * 1e3,
            "ratio": s / b}  # fmt: skip


_STEP_SCRIPT = r"""
import json, os, sys, tempfile, threading, time
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from rlhf_ext.trl.segment_ppo import SegmentPPOConfig, SegmentPPOTrainer

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

policy, rm, estimator = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(policy)
prompts = Dataset.from_list([{"prompt": "Question: What should I know about tides?\nAnswer:"}] * 64)
with tempfile.TemporaryDirectory() as tmp:
    args = SegmentPPOConfig(output_dir=tmp, reward_model_path=rm, granularity="segment", advantage_estimator=estimator,
        normalizer_kind="none",
        per_device_train_batch_size=16, num_generations=2, max_completion_length=64, max_steps=2, bf16=False,
        use_cpu=True, report_to="none", save_strategy="no", gradient_checkpointing=False, disable_tqdm=True)
    trainer = SegmentPPOTrainer(model=policy, args=args, train_dataset=prompts, processing_class=tok)
    base, peak, done = rss_mb(), [0.0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.002)
    thread = threading.Thread(target=sample)
    thread.start()
    trainer.train()
    done.set()
    thread.join()
params = sum(p.numel() for p in trainer.model.parameters())
critic = sum(p.numel() for p in trainer.critic.model.parameters()) if trainer.critic is not None else 0
print(json.dumps({"rss_before_mb": base, "peak_rss_during_steps_mb": peak[0], "step_delta_mb": peak[0] - base,
                  "policy_params": params, "critic_params": critic}))
"""


def step_memory(policy_dir: str, rm_dir: str, estimator: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _STEP_SCRIPT, policy_dir, rm_dir, estimator], capture_output=True, text=True, check=True
    ).stdout
    return {"estimator": estimator, **json.loads(out.strip().splitlines()[-1])}


def ppo_curve(out_dir: str) -> list[dict]:
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, run_segment_ppo

    recipe_file = Path(__file__).resolve().parents[1] / "rlhf_ext" / "recipes" / "segment_ppo_tiny.yaml"
    recipe = load_recipe(
        SegmentPPORecipe,
        recipe_file,
        [f"train.output_dir={out_dir}", "train.max_steps=16", "segment.granularity=segment"],
    )  # paper mode, as recorded
    return run_segment_ppo(recipe)["curve"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/segment_ppo.json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from rlhf_ext.pipelines.builtins import resolve_model

    sft, rm = resolve_model("builtin:tiny-sft"), resolve_model("builtin:tiny-segment-rm")
    repeats = 5 if args.quick else 11
    results: dict = {"reward_cost": [reward_cost("tiny policy + tiny RM", sft, rm, 16, 128, repeats)]}
    if not args.quick:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        smol = resolve_model("builtin:smollm2")
        with tempfile.TemporaryDirectory() as tmp:  # SmolLM2-135M architecture for policy, reference and RM
            cfg = AutoConfig.from_pretrained(smol)
            pol, rmd = Path(tmp) / "policy", Path(tmp) / "rm"
            AutoModelForCausalLM.from_config(cfg).save_pretrained(pol)
            cfg.num_labels = 1
            AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rmd)
            for d in (pol, rmd):
                AutoTokenizer.from_pretrained(smol).save_pretrained(d)
            settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5, "sft_model_name_or_path": str(pol)}
            (rmd / "segment_config.json").write_text(json.dumps(settings))
            results["reward_cost"].append(reward_cost("SmolLM2-135M arch (x2)", str(pol), str(rmd), 8, 128, 5))
    results["step_memory"] = [step_memory(sft, rm, "gae"), step_memory(sft, rm, "reinforce")]
    with tempfile.TemporaryDirectory() as tmp:
        results["curve"] = ppo_curve(tmp)
    results["machine"] = machine_info()

    print("\nReward production for one PPO batch (reference forward + reward-model forward + reward shaping)")
    print(
        f"{'models':26s} {'batch':>5} {'tokens':>6} {'bandit ms':>10} {'segment ms':>11} {'ratio':>6}  target <= 1.05x"
    )
    for r in results["reward_cost"]:
        print(f"{r['models']:26s} {r['batch']:5d} {r['completion']:6d} {r['bandit_ms']:10.1f} {r['segment_ms']:11.1f} "
              f"{r['ratio']:6.3f}")  # fmt: skip
    print("\nPeak memory of two tiny PPO steps (RSS sampled every 2 ms in a fresh process, MB)")
    print(f"{'advantages':12s} {'RSS before':>11} {'peak':>8} {'step delta':>11} {'critic params':>14}")
    for r in results["step_memory"]:
        name = "gae + critic" if r["estimator"] == "gae" else "reinforce"
        print(f"{name:12s} {r['rss_before_mb']:11.0f} {r['peak_rss_during_steps_mb']:8.0f} {r['step_delta_mb']:11.1f} "
              f"{r['critic_params']:14,d}")  # fmt: skip
    print("\nShort PPO run (segment_ppo_tiny, 16 steps): reward (with KL), KL, RM score at the last token")
    print(f"{'step':>4} {'reward':>8} {'KL':>7} {'RM':>7}")
    for row in results["curve"]:
        print(f"{row['step']:4d} {row['reward']:8.2f} {row['segment/kl']:7.3f} {row['segment/raw_last_score']:7.3f}")
    out = Path(args.out)
    atomic_write_json(out, results)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
