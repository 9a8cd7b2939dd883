"""Iterative online DPO per preference pair next to TRL's ``OnlineDPOTrainer``, n = 2 (issue 28). Prints a table and
writes JSON; never part of the test run.

    python benchmarks/online_dpo_step.py [--prompts 64] [--rounds 5] [--out benchmarks/results/online_dpo_step.json]
    python benchmarks/online_dpo_step.py --quick      # the target's 64 prompts, 3 rounds -> online_dpo_step_quick.json

Both contenders start from the builtin tiny SFT policy, sample 2 responses per prompt (temperature 1.0, the same
``max_new_tokens``), score them with the same reward model (a sequence classifier on the tiny trunk, built once), and
train DPO (sigmoid, beta 0.1, same batch and learning rate) on one pair per prompt, in this process, one torch thread:

- ours: one iteration of :class:`~rlhf_ext.trl.IterativeDPOTrainer` (``run_iteration``: sample, score, select, store,
  one DPO run over the iteration's pairs with ``pair_data="latest"``, save ``pi_{t+1}``, evaluate it on one prompt);
  ``--prompts`` prompts per iteration;
- TRL: ``--prompts / batch`` steps of ``OnlineDPOTrainer`` (its ``training_step``: generate, policy and reference
  forwards, reward, loss, backward; then gradient clipping, optimizer and scheduler steps, as its training loop does),
  with the trainer built once: TRL's steady state, its set-up amortised over a whole run.

Timing: ``_timing.interleaved`` (thread CPU time, order rotating each round), one round = one iteration of ours and the
same number of prompts through TRL; the figure is the median over rounds of (ours CPU per stored pair) / (TRL CPU per
pair), p25-p75 beside it. Wall times on the shared machine are not used. ``--profile`` adds a cProfile of one more
iteration of ours (top entries by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _timing import interleaved, machine_probe, one_thread, paired_ratio, summary_row

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TORCHDYNAMO_DISABLE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).resolve().parent / "results"
FIGURE = "iterative online DPO per pair vs TRL OnlineDPOTrainer, n=2"


def reward_model(root: Path, base: str) -> str:
    """The shared reward model: a sequence classifier on the tiny base trunk, score head seeded (timing only)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = root / "reward_model"
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(base)
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
        model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return str(out)


def ours(sft: str, rm: str, prompts: list[str], work: Path, m: int, batch: int, max_new_tokens: int, lr: float):
    """A callable running the next iteration of one IterativeDPOTrainer run; returns (callable, stored pairs list)."""
    from rlhf_ext.runtime.iterations import run_iteration
    from rlhf_ext.trl import IterativeDPOConfig, IterativeDPOTrainer
    from rlhf_ext.trl.args import CPU_RUN

    args = IterativeDPOConfig(
        output_dir=str(work / "ours"),
        num_iterations=10_000,
        prompts_per_iteration=m,
        num_generations=2,
        temperatures=[1.0],
        max_completion_length=max_new_tokens,
        pair_data="latest",
        per_device_train_batch_size=batch,
        num_train_epochs=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        beta=0.1,
        max_length=256,
        **CPU_RUN,
        logging_steps=10_000,
        eval_num_prompts=1,
        eval_samples_per_prompt=1,
        generation_threads=1,
        training_threads=1,
        seed=0,
    )
    trainer = IterativeDPOTrainer(sft, rm, args=args, train_dataset=prompts)
    trainer.open_run()
    trainer.evaluate_policy(0)
    counter = itertools.count()
    pairs: list[dict] = []

    def step() -> None:
        record = run_iteration(trainer, next(counter))
        pairs.append(record["pairs"])

    return step, pairs


def trl(sft: str, rm: str, prompts: list[str], work: Path, m: int, batch: int, max_new_tokens: int, lr: float):
    """A callable running ``m / batch`` steps of TRL's OnlineDPOTrainer (its training loop's per-step work)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from rlhf_ext.trl.args import CPU_RUN

    tok = AutoTokenizer.from_pretrained(sft)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    args = OnlineDPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=batch,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        beta=0.1,
        max_length=256,
        **CPU_RUN,
        logging_steps=10_000,
        seed=0,
    )
    trainer = OnlineDPOTrainer(
        model=sft,
        reward_funcs=rm,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        reward_processing_classes=tok,
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=10_000)
    model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    batches = itertools.chain.from_iterable(itertools.repeat(trainer.get_train_dataloader()))

    def step() -> None:
        for _ in range(m // batch):
            trainer.training_step(model, next(batches))
            trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad()

    return step


def profile_ours(step, top: int = 45) -> list[str]:
    """cProfile (thread CPU time) of one more iteration of ours: the ``top`` entries by cumulative time."""
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per iteration (pairs per round)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--batch", type=int, default=8, help="pairs per DPO step, both contenders")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--profile", action="store_true", help="also cProfile one more iteration of ours")
    parser.add_argument("--quick", action="store_true", help="64 prompts (the target's), 3 rounds; *_quick.json")
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    if a.quick:
        a.prompts, a.rounds = 64, 3
    if a.prompts % a.batch:
        parser.error(f"--prompts ({a.prompts}) must be a multiple of --batch ({a.batch})")
    out = a.out or RESULTS / ("online_dpo_step_quick.json" if a.quick else "online_dpo_step.json")

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.io import atomic_write_json
    from rlhf_ext.zoo.toy import toy_preference_dataset

    one_thread()
    sft, base = resolve_model("builtin:tiny-sft"), resolve_model("builtin:tiny")
    prompts = list(toy_preference_dataset(n_train=512, n_test=8, seed=0)["train"]["prompt"])
    work = Path(tempfile.mkdtemp(prefix="online_dpo_step_"))
    try:
        rm = reward_model(work, base)
        settings = (sft, rm, prompts, work, a.prompts, a.batch, a.max_new_tokens, a.learning_rate)
        ours_step, ours_pairs = ours(*settings)
        trl_step = trl(*settings)
        machine_before = machine_probe()
        times = interleaved({"ours": ours_step, "trl": trl_step}, rounds=a.rounds, warmup=a.warmup)
        machine = {**machine_probe(), "cpu_share_before": machine_before["cpu_share"]}
        pairs = [p["num_pairs"] for p in ours_pairs[a.warmup :]]
        per_pair = {
            "ours": [t / n for t, n in zip(times["ours"], pairs, strict=True)],
            "trl": [t / a.prompts for t in times["trl"]],
        }
        ratio = paired_ratio(per_pair, "ours", "trl")
        profile = profile_ours(ours_step) if a.profile else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "figure": FIGURE,
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "cpu_seconds_per_round": times,
        "ours_pairs_per_round": pairs,
        "cpu_seconds_per_pair": per_pair,
        "ratio_per_pair": ratio,
        "machine": machine,
        "note": "thread CPU time of contenders interleaved in one process, one torch thread; the machine is shared "
        "(2 cores, other jobs), so wall times are not used",
        "summary": [
            summary_row(
                f"{FIGURE}, {a.prompts} prompts per iteration",
                "IterativeDPOTrainer, one iteration per round",
                "trl OnlineDPOTrainer steps (steady state)",
                ratio,
                "<= 0.95x at 64 prompts",
                machine,
            )
        ],
    }
    if profile is not None:
        result["profile_ours_one_iteration"] = profile
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    print(f"{FIGURE}, {a.prompts} prompts/iteration, {a.rounds} rounds (CPU s per pair, median):")
    for name in ("ours", "trl"):
        s = sorted(per_pair[name])
        print(f"  {name:5s} {s[len(s) // 2]:.4f}")
    print(f"  ratio {ratio['median']:.3f}x [{ratio['p25']:.3f}-{ratio['p75']:.3f}]  machine {machine}")
    if profile is not None:
        print("\n".join(profile))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
