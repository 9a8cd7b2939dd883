"""One training step of ``SegmentPPOTrainer`` next to stock TRL ``GRPOTrainer``. Prints a table and writes JSON;
never part of the tests.

All variants live in one process, share one tiny policy (2-layer Llama built from config, GPT-2 vocabulary; no
network), one prompt batch and the same seeds, and are timed interleaved: after the warm-up steps every repetition runs
each variant once (the order rotates by one per repetition). A step is what ``Trainer`` does per optimizer step:
generation, scoring (reward, reference / old log-probs), loss, backward, grad clipping, optimizer step.

(a) ``GRPOTrainer`` with ``beta=0``; (b) ``GRPOTrainer`` with ``beta>0`` (pays the reference forward);
(c) ``SegmentPPOTrainer`` REINFORCE with a plain reward function (bandit reward, KL reward to the reference);
(c0) the same with the old-log-prob policy forward forced back on (the cost before the on-policy skip);
(d) ``SegmentPPOTrainer`` REINFORCE with segment granularity and a tiny segment reward model;
(e) (c) with a dense reward function: about the same reward as spans over the even tokens' characters, mapped onto
the policy's tokens (issue 27: the cost of a dense callable over a scalar one is (e)/(c)).
Target: (c)/(b) <= 1.03.

    python benchmarks/segment_ppo_step.py [--out benchmarks/results/segment_ppo_step.json] [--quick] [--variants c,e]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhf_ext.runtime.io import atomic_write_json, machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

TOKENIZER = None  # the policy's, for even_token_spans
RATIOS = [("c", "b"), ("c", "a"), ("c0", "b"), ("d", "b"), ("b", "a"), ("e", "c")]
VARIANTS = {
    "a": "GRPOTrainer beta=0",
    "b": "GRPOTrainer beta=0.04",
    "c": "SegmentPPO reinforce, bandit reward_funcs",
    "c0": "  (c) with the old-logp forward (before)",
    "d": "SegmentPPO reinforce, segment RM",
    "e": "SegmentPPO reinforce, dense span reward_funcs",
}


def even_token_reward(completion_ids, **kwargs):
    """A plain reward function: the fraction of even token ids in each completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def even_token_spans(completions, completion_ids, processing_class=None, **kwargs):
    """The reward of :func:`even_token_reward` as spans: each even token's characters earn ``1 / len(ids)``."""
    from rlhf_ext.runtime.spans import token_char_offsets

    out = []
    for ids in completion_ids:
        _, offsets = token_char_offsets(TOKENIZER, ids)
        out.append([(a, b, 1 / len(ids)) for t, (a, b) in zip(ids, offsets) if t % 2 == 0 and b > a])
    return out


def prompt(i: int) -> str:
    return f"Question: what should I know about tide {i}?\nAnswer:"


def build_models(root: Path) -> tuple[str, str]:
    """A tiny policy checkpoint and a tiny segment reward model sharing its tokenizer."""
    from rlhf_ext.zoo.models import save_tiny_checkpoint, tiny_reward_model
    from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    policy = save_tiny_checkpoint(root / "policy", tokenizer=tok, seed=0)
    rm = save_tiny_checkpoint(root / "rm", model=tiny_reward_model(tok, seed=1), tokenizer=tok)
    settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5, "sft_model_name_or_path": str(policy)}
    (rm / "segment_config.json").write_text(json.dumps(settings))
    return str(policy), str(rm)


def make_trainers(policy: str, rm: str, tmp: str, batch: int, completion: int, lr: float, variants) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_ext.trl.segment_ppo import SegmentPPOConfig, SegmentPPOTrainer

    global TOKENIZER
    tok = TOKENIZER = AutoTokenizer.from_pretrained(policy)
    prompts = Dataset.from_list([{"prompt": prompt(i)} for i in range(64)])
    common = dict(
        per_device_train_batch_size=batch, num_generations=2, max_completion_length=completion, learning_rate=lr,
        loss_type="bnpo", scale_rewards="none", bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        gradient_checkpointing=False, disable_tqdm=True, seed=0, max_steps=1,
        generation_kwargs={"min_new_tokens": completion},  # every variant generates the same number of tokens
    )  # fmt: skip
    segment = dict(advantage_estimator="reinforce", normalizer_kind="none", kl_coef=0.01)
    trainers = {
        "a": GRPOTrainer(policy, even_token_reward, GRPOConfig(f"{tmp}/a", beta=0.0, **common), prompts,
                         processing_class=tok),
        "b": GRPOTrainer(policy, even_token_reward, GRPOConfig(f"{tmp}/b", beta=0.04, **common), prompts,
                         processing_class=tok),
        "c": SegmentPPOTrainer(policy, even_token_reward, SegmentPPOConfig(f"{tmp}/c", granularity="bandit",
                               **segment, **common), prompts, processing_class=tok),
        "c0": SegmentPPOTrainer(policy, even_token_reward, SegmentPPOConfig(f"{tmp}/c0", granularity="bandit",
                                **segment, **common), prompts, processing_class=tok),
        "d": SegmentPPOTrainer(policy, args=SegmentPPOConfig(f"{tmp}/d", reward_model_path=rm, granularity="segment",
                               entropy_cutoff=2.0, **segment, **common), train_dataset=prompts, processing_class=tok),
        "e": SegmentPPOTrainer(policy, even_token_spans, SegmentPPOConfig(f"{tmp}/e", granularity="segment",
                               **segment, **common), prompts, processing_class=tok),
    }  # fmt: skip
    trainers = {k: v for k, v in trainers.items() if k in variants}
    if "c0" in trainers:
        trainers["c0"]._reuse_policy_logps = False  # the no-grad old-log-prob forward of every rollout, as before
    for trainer in trainers.values():
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1
    return trainers


def count_policy_forwards(trainer) -> dict:
    """Counts the policy's forward calls outside ``generate`` (from now on)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    counts = {"forwards": 0, "in_generate": False}
    generate = model.generate

    def counted_generate(*args, **kwargs):
        counts["in_generate"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            counts["in_generate"] = False

    def pre_hook(module, args):
        counts["forwards"] += not counts["in_generate"]

    model.register_forward_pre_hook(pre_hook)
    model.generate = counted_generate
    return counts


CLOCK = time.perf_counter  # --clock cpu: time.process_time (CPU seconds; steadier on a loaded machine)


def train_step(trainer, rows: list[dict], seed: int) -> float:
    """One optimizer step on ``rows`` (a generation batch); seconds of :data:`CLOCK`."""
    torch.manual_seed(seed)
    trainer._step, trainer._buffered_inputs = 0, None  # generate now
    t0 = CLOCK()
    trainer.training_step(trainer.model, rows, None)  # rollout + scoring + loss + backward
    trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return CLOCK() - t0


def summary(times: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(times, n=4)
    ms = [t * 1e3 for t in times]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "q1_ms": q1 * 1e3,
            "q3_ms": q3 * 1e3, "times_ms": ms}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/segment_ppo_step.json")
    parser.add_argument("--quick", action="store_true", help="batch 8 x 32 tokens (else 16 x 64)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    batch, completion = (8, 32) if args.quick else (16, 64)
    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = build_models(Path(tmp))
        trainers = make_trainers(policy, rm, tmp, batch, completion, 1e-6, args.variants.split(","))
        rows = [{"prompt": prompt(i)} for i in range(batch // 2)]
        rows = [row for row in rows for _ in range(2)]  # num_generations = 2, as GRPO's sampler repeats them
        names = list(trainers)
        forwards = {}
        for name in names:  # the first warm-up step also counts the policy forwards outside generation
            counts = count_policy_forwards(trainers[name])
            train_step(trainers[name], rows, seed=0)
            forwards[name] = counts["forwards"]
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.warmup - 1 + args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                seconds = train_step(trainers[name], rows, seed=rep + 1)
                if rep >= args.warmup - 1:
                    times[name].append(seconds)
    steps = {name: {"label": VARIANTS[name], "policy_forwards_per_step": forwards[name], **summary(times[name])}
             for name in names}  # fmt: skip
    med = {name: steps[name]["median_ms"] for name in names}
    results = {
        "setting": {
            "batch": batch,
            "num_generations": 2,
            "completion_tokens": completion,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "threads": args.threads,
            "clock": args.clock,
            "model": "tiny Llama (2 layers, hidden 64)",
            "interleaved": "every repetition runs each variant once, order rotated",
        },
        "steps": steps,
        "ratios": {f"{x}/{y}": med[x] / med[y] for x, y in RATIOS if x in med and y in med},
        **({"target": {"c/b": 1.03, "met": med["c"] / med["b"] <= 1.03}} if {"b", "c"} <= med.keys() else {}),
        "machine": machine_info(),
    }
    print(f"\nOne training step (generation + scoring + loss + backward + optimizer), batch {batch} x {completion} "
          f"tokens, median of {args.repeats} interleaved repetitions after {args.warmup} warm-ups\n")  # fmt: skip
    base = "b" if "b" in med else names[0]
    print(f"| variant | policy fwd/step | median ms | IQR ms | min-max ms | vs ({base}) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        s = steps[name]
        print(f"| ({name}) {s['label'].strip()} | {s['policy_forwards_per_step']} | {s['median_ms']:.1f} | "
              f"{s['q1_ms']:.1f}-{s['q3_ms']:.1f} | {s['min_ms']:.1f}-{s['max_ms']:.1f} | "
              f"{s['median_ms'] / med[base]:.3f} |")  # fmt: skip
    r = results["ratios"]
    print("\n" + ", ".join(f"({k.replace('/', ')/(')}) = {v:.3f}" for k, v in r.items()) + "  (target (c)/(b) <= 1.03)")
    out = Path(args.out)
    atomic_write_json(out, results)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
