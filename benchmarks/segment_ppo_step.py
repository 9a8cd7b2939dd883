"""One training step of ``DensePPOTrainer`` (``SegmentPPOTrainer``) next to stock TRL ``GRPOTrainer``, and its GAE
critic's cost next to OpenRLHF's critic on the same model. Prints a table and writes JSON; never part of the tests.

All variants live in one process, share one policy (a tiny 2-layer Llama built from config with the GPT-2 vocabulary,
or SmolLM2-135M with ``--model smollm2``; no network), one prompt batch and the same seeds, and are timed by
``benchmarks/_timing.py``: one torch thread, thread CPU time, interleaved rounds (the order rotating), each figure the
median [p25-p75] of the per-round paired ratios. A step is what ``Trainer`` does per optimizer step: generation,
scoring (reward, reference / old log-probs, critic values), loss, backward, grad clipping, optimizer step.

(a) ``GRPOTrainer`` with ``beta=0``; (b) ``GRPOTrainer`` with ``beta>0`` (pays the reference forward);
(c) ``DensePPOTrainer`` REINFORCE with a plain reward function (bandit reward, KL reward to the reference);
(c0) the same with the old-log-prob policy forward forced back on (the cost before the on-policy skip);
(d) ``DensePPOTrainer`` REINFORCE with segment granularity and a tiny segment reward model (tiny model only);
(e) (c) with a dense reward function: about the same reward as spans over the even tokens' characters, mapped onto
the policy's tokens (issue 27: the cost of a dense callable over a scalar one is (e)/(c));
(g) ``DensePPOTrainer`` GAE with a critic (the policy with a fresh value head), the reward of (c);
(g0) (g) as before issue 28: the no-grad old-log-prob policy forward and torch's per-parameter critic AdamW.

Critic cost per step (the GAE variant's critic): our rollout value forward + ``_critic_step`` (forward, clipped value
loss, backward, grad clip, fused AdamW) vs OpenRLHF 0.11.2's own critic built by ``get_llm_for_sequence_regression``
(its ``CriticModel``): the experience maker's no-grad value forward + ``CriticPPOTrainer.training_step``'s forward,
``ValueLoss``, backward, grad clip and the optimizer DeepSpeed builds on CPU (``torch_adam``: ``torch.optim.AdamW``,
per-parameter on CPU), in-process without Ray or DeepSpeed, cast to our critic's dtype (fp32); the same batch.

    python benchmarks/segment_ppo_step.py [--quick] [--model tiny|smollm2] [--variants b,c,g] [--rounds N] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from _timing import interleaved, machine_probe, one_thread, paired_ratio, spread, summary_row

from rlhf_ext.runtime.io import atomic_write_json, machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

TOKENIZER = None  # the policy's, for even_token_spans
#: (ours, alternative, figure, target): the ratios of the issue's table (``summary``), then the other ratios
SUMMARY = [
    ("c", "b", "DensePPO step, REINFORCE, vs GRPOTrainer + KL", "< 1.00x"),
    ("g", "b", "DensePPO step, GAE + critic, vs GRPOTrainer + KL", "no avoidable cost (g vs g0)"),
    ("g", "g0", "DensePPO GAE step vs before (old-log-prob forward, per-parameter critic AdamW)", "< 1.00x"),
]
RATIOS = [("c", "a"), ("c0", "b"), ("d", "b"), ("b", "a"), ("e", "c")]
VARIANTS = {
    "a": "GRPOTrainer beta=0",
    "b": "GRPOTrainer beta=0.04",
    "c": "DensePPO reinforce, bandit reward_funcs",
    "c0": "  (c) with the old-logp forward (before)",
    "d": "DensePPO reinforce, segment RM",
    "e": "DensePPO reinforce, dense span reward_funcs",
    "g": "DensePPO GAE + critic, bandit reward_funcs",
    "g0": "  (g) as before: old-logp forward, per-parameter critic AdamW",
}
QUICK_VARIANTS = "b,c,g,g0"


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


def build_models(root: Path, model: str) -> tuple[str, str | None]:
    """The policy checkpoint and (tiny model only) a tiny segment reward model sharing its tokenizer."""
    if model == "smollm2":
        from rlhf_ext.pipelines.builtins import resolve_model

        return resolve_model("builtin:smollm2"), None
    from rlhf_ext.zoo.models import save_tiny_checkpoint, tiny_reward_model
    from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    policy = save_tiny_checkpoint(root / "policy", tokenizer=tok, seed=0)
    rm = save_tiny_checkpoint(root / "rm", model=tiny_reward_model(tok, seed=1), tokenizer=tok)
    settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5, "sft_model_name_or_path": str(policy)}
    (rm / "segment_config.json").write_text(json.dumps(settings))
    return str(policy), str(rm)


def make_trainers(policy: str, rm: str | None, tmp: str, batch: int, completion: int, lr: float, variants) -> dict:
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
    segment = dict(normalizer_kind="none", kl_coef=0.01)
    builders = {
        "a": lambda: GRPOTrainer(policy, even_token_reward, GRPOConfig(f"{tmp}/a", beta=0.0, **common), prompts,
                                 processing_class=tok),
        "b": lambda: GRPOTrainer(policy, even_token_reward, GRPOConfig(f"{tmp}/b", beta=0.04, **common), prompts,
                                 processing_class=tok),
        "d": lambda: SegmentPPOTrainer(policy, args=SegmentPPOConfig(f"{tmp}/d", reward_model_path=rm,
                                       granularity="segment", entropy_cutoff=2.0, advantage_estimator="reinforce",
                                       **segment, **common), train_dataset=prompts, processing_class=tok),
        "e": lambda: SegmentPPOTrainer(policy, even_token_spans, SegmentPPOConfig(f"{tmp}/e", granularity="segment",
                                       advantage_estimator="reinforce", **segment, **common), prompts,
                                       processing_class=tok),
    }  # fmt: skip
    for name, estimator in (("c", "reinforce"), ("c0", "reinforce"), ("g", "gae"), ("g0", "gae")):
        config = SegmentPPOConfig(f"{tmp}/{name}", granularity="bandit", advantage_estimator=estimator, **segment,
                                  **common)  # fmt: skip
        builders[name] = lambda config=config: SegmentPPOTrainer(policy, even_token_reward, config, prompts,
                                                                 processing_class=tok)  # fmt: skip
    trainers = {name: builders[name]() for name in variants}
    for name in ("c0", "g0"):
        if name in trainers:
            trainers[name]._reuse_policy_logps = False  # the no-grad old-log-prob forward of every rollout, as before
    if "g0" in trainers:  # torch's default AdamW (per-parameter on CPU), as the critic's optimizer was
        critic = trainers["g0"].critic
        critic.optimizer = torch.optim.AdamW(critic.model.parameters(), lr=9e-6, betas=(0.9, 0.95))
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


def train_step(trainer, rows: list[dict], seed: int) -> None:
    """One optimizer step on ``rows`` (a generation batch)."""
    torch.manual_seed(seed)
    trainer._step, trainer._buffered_inputs = 0, None  # generate now
    trainer.training_step(trainer.model, rows, None)  # rollout + scoring + loss + backward (+ the critic's step)
    trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def stepper(trainer, rows: list[dict]):
    """A contender for :func:`interleaved`: its i-th call is the step with seed i (the same rollout in every
    variant's i-th round)."""
    calls = iter(range(1, 1 << 30))
    return lambda: train_step(trainer, rows, next(calls))


def critic_cost(trainer, policy: str, rows: list[dict], rounds: int) -> dict:
    """Per-step critic cost of ``trainer`` (a GAE ``DensePPOTrainer``) vs OpenRLHF's critic on the same model and
    batch; ``{name: [seconds per round]}`` from :func:`interleaved` and the batch shape."""
    from rlhf_ext.openrlhf.compat import import_shims

    with import_shims():  # OpenRLHF's model modules import flash_attn at module level
        from openrlhf.models import ValueLoss, get_llm_for_sequence_regression

    torch.manual_seed(0)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)  # a rollout: ids, masks, old_values
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    action_mask = batch["completion_mask"]
    c = action_mask.size(1)
    inputs = {key: batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    old_values = batch["old_values"]
    inputs["old_values"] = old_values
    inputs["returns"] = old_values + 0.1 * torch.randn(old_values.shape, generator=torch.Generator().manual_seed(0))

    def ours() -> None:
        with torch.no_grad():  # the rollout's value forward
            trainer.critic.values(input_ids, attention_mask, c)
        trainer._critic_step(inputs)  # forward, clipped value loss, backward, clip, fused AdamW (every step)

    dtype = next(trainer.critic.model.parameters()).dtype
    theirs = get_llm_for_sequence_regression(policy, "critic", param_dtype="bf16", attn_implementation="sdpa",
                                             init_value_head=True).to(dtype)  # fmt: skip
    value_loss = ValueLoss(trainer.args.value_clip)
    optimizers = {
        "openrlhf": torch.optim.AdamW(theirs.parameters(), lr=9e-6, betas=(0.9, 0.95)),  # DeepSpeed's torch_adam
    }

    def openrlhf() -> None:
        theirs.eval()
        with torch.no_grad():  # the experience maker's value forward
            theirs(input_ids, action_mask=action_mask, attention_mask=attention_mask)
        theirs.train()  # CriticPPOTrainer.training_step
        values = theirs(input_ids, action_mask=action_mask, attention_mask=attention_mask)
        loss = value_loss(values, old_values, inputs["returns"], action_mask=action_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), trainer.args.max_grad_norm)
        optimizers["openrlhf"].step()
        optimizers["openrlhf"].zero_grad(set_to_none=True)

    times = interleaved({"ours": ours, "openrlhf": openrlhf}, rounds, warmup=1)
    return {"times": times, "batch": list(input_ids.shape), "completion_tokens": c}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/segment_ppo_step[_MODEL][_quick].json")
    parser.add_argument("--quick", action="store_true", help=f"batch 8 x 32 tokens, variants {QUICK_VARIANTS}, "
                        "3 rounds (a few minutes); else 16 x 64, all variants, 9 rounds")  # fmt: skip
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 3 quick, 9 else)")
    parser.add_argument("--variants", default=None, help="comma-separated (default: all; --quick: b,c,g,g0)")
    parser.add_argument("--batch", type=int, default=None, help="rollout batch (default: 8 quick, 16 else)")
    parser.add_argument("--completion", type=int, default=None, help="completion tokens (default: 32 quick, 64)")
    args = parser.parse_args()
    one_thread()
    batch = args.batch or (8 if args.quick else 16)
    completion = args.completion or (32 if args.quick else 64)
    rounds = args.rounds or (3 if args.quick else 9)
    default = QUICK_VARIANTS if args.quick or args.model == "smollm2" else ",".join(VARIANTS)
    variants = (args.variants or default).split(",")
    stem = "segment_ppo_step" + ("" if args.model == "tiny" else f"_{args.model}") + ("_quick" if args.quick else "")
    out = Path(args.out or f"benchmarks/results/{stem}.json")
    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = build_models(Path(tmp), args.model)
        if rm is None and "d" in variants:
            parser.error("variant d needs the tiny segment reward model (--model tiny)")
        trainers = make_trainers(policy, rm, tmp, batch, completion, 1e-6, variants)
        rows = [{"prompt": prompt(i)} for i in range(batch // 2)]
        rows = [row for row in rows for _ in range(2)]  # num_generations = 2, as GRPO's sampler repeats them
        forwards = {}
        for name, trainer in trainers.items():  # a warm-up step that also counts the policy forwards
            counts = count_policy_forwards(trainer)
            train_step(trainer, rows, seed=0)
            forwards[name] = counts["forwards"]
        probe_before = machine_probe()
        times = interleaved({name: stepper(t, rows) for name, t in trainers.items()}, rounds, warmup=1)
        critic = critic_cost(trainers["g"], policy, rows, rounds) if "g" in trainers else None
        probe = machine_probe()
    steps = {name: {"label": VARIANTS[name].strip(), "policy_forwards_per_step": forwards[name],
                    "cpu_ms": {k: v * 1e3 if k != "n" else v for k, v in spread(times[name]).items()},
                    "times_ms": [t * 1e3 for t in times[name]]} for name in trainers}  # fmt: skip
    model = "tiny Llama (2 layers, hidden 64)" if args.model == "tiny" else "SmolLM2-135M (builtin:smollm2)"
    where = f"{model}, batch {batch} x {completion} tokens"
    rows_out, ratios = [], {}
    for ours, theirs, figure, target in SUMMARY:
        if ours in times and theirs in times:
            ratio = ratios[f"{ours}/{theirs}"] = paired_ratio(times, ours, theirs)
            rows_out.append(summary_row(f"{figure} ({where})", f"({ours}) {VARIANTS[ours].strip()}",
                                        f"({theirs}) {VARIANTS[theirs].strip()}", ratio, target, probe))  # fmt: skip
    for ours, theirs in RATIOS:
        if ours in times and theirs in times:
            ratios[f"{ours}/{theirs}"] = paired_ratio(times, ours, theirs)
    results = {
        "setting": {"model": model, "batch": batch, "num_generations": 2, "completion_tokens": completion,
                    "rounds": rounds, "warmup_rounds": 1, "threads": 1, "clock": "thread CPU time",
                    "interleaved": "every round runs each variant once, order rotated (benchmarks/_timing.py)"},
        "steps": steps,
        "ratios": ratios,
    }  # fmt: skip
    if critic is not None:
        ct = critic["times"]
        critic_ratio = paired_ratio(ct, "ours", "openrlhf")
        results["critic_per_step"] = {
            "batch_shape": critic["batch"], "ours_cpu_ms": {k: v * 1e3 if k != "n" else v for k, v in
                                                           spread(ct["ours"]).items()},
            "openrlhf_cpu_ms": {k: v * 1e3 if k != "n" else v for k, v in spread(ct["openrlhf"]).items()},
            "ratio": critic_ratio,
            "g_step_cpu_ms": steps["g"]["cpu_ms"]["median"],
        }  # fmt: skip
        rows_out.append(summary_row(
            f"GAE critic cost per step vs OpenRLHF's critic ({where})",
            "value forward + _critic_step (fused AdamW)",
            "OpenRLHF CriticModel: value forward + training_step (torch_adam AdamW), no Ray/DeepSpeed",
            critic_ratio, "stated", probe,
        ))  # fmt: skip
    results["summary"] = rows_out
    results["machine"] = {**machine_info(), "probe_before": probe_before, "probe_after": probe}
    print(f"\nOne training step (generation + scoring + loss + backward + optimizer), {where}; thread CPU time, "
          f"{rounds} interleaved rounds after 1 warm-up\n")  # fmt: skip
    print("| variant | policy fwd/step | median CPU ms | p25-p75 ms |")
    print("|---|---:|---:|---:|")
    for name, s in steps.items():
        ms = s["cpu_ms"]
        print(f"| ({name}) {s['label']} | {s['policy_forwards_per_step']} | {ms['median']:.1f} | "
              f"{ms['p25']:.1f}-{ms['p75']:.1f} |")  # fmt: skip
    print("\n| ratio | median | p25-p75 |\n|---|---:|---:|")
    for key, r in ratios.items():
        print(f"| ({key.replace('/', ')/(')}) | {r['median']:.3f} | {r['p25']:.3f}-{r['p75']:.3f} |")
    if critic is not None:
        c = results["critic_per_step"]
        print(f"\ncritic per step, batch {c['batch_shape']}: ours {c['ours_cpu_ms']['median']:.1f} ms, OpenRLHF "
              f"{c['openrlhf_cpu_ms']['median']:.1f} ms, ratio {c['ratio']['median']:.3f} "
              f"[{c['ratio']['p25']:.3f}-{c['ratio']['p75']:.3f}]; (g) step {c['g_step_cpu_ms']:.1f} ms")  # fmt: skip
    print(f"machine: {probe_before} -> {probe}")
    atomic_write_json(out, results)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
