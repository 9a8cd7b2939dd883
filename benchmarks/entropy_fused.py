"""Entropy in the pass that computes the log-softmax (issue 28, rows 1 and 3). Prints tables and writes JSON with
the rows of ``make bench``'s summary; never part of the tests.

Every figure is a paired ratio of contenders run side by side in this process (``_timing``: one torch thread,
thread CPU time, interleaved rounds, median [p25-p75]); wall times on the shared 2-core machine mean nothing.

1. Kernel, ``[4, 24, 49152]`` fp32 logits (a PPO batch of 4 x 24 action tokens at SmolLM2's vocabulary):
   ``logprobs_and_entropy`` (log-probs + entropies) vs OpenRLHF's ``log_probs_from_logits`` (log-probs alone: the
   cost the entropy adds to), OpenRLHF's ``compute_entropy`` (eager, as with ``TORCHDYNAMO_DISABLE=1``) and the
   ``token_entropy`` of rlhf-ext before this change.
2. OpenRLHF make_experience, segment vs stock, SmolLM2-135M (``builtin:smollm2``), OpenRLHF's own ``Actor`` and
   reward model called in-process (no Ray), a batch of 4 rollouts x (32 prompt + 24 action) tokens. Stock: the
   reference ``Actor`` forward (log-probs), the policy ``Actor`` forward, the reward model's scalar, as OpenRLHF's
   ``make_experience`` calls them. Segment: the ``SegmentReferenceModelActor`` and ``SegmentRewardModelActor``
   forwards (log-probs + entropies, scores at every position), the same policy forward, then
   ``SegmentExperienceMaker.attach_dense_rewards`` (segmentation, normalisation, interpolation). Target <= 1.005x.
3. TRL path, segment reward production vs stock bandit for one PPO batch: stock = the reference model's log-probs
   through TRL's fused head (``add_fused_lm_head``) + the reward model's score + bandit rewards; segment =
   ``DensePPOTrainer``'s reference forward (log-probs + entropies) + scores at every position + dense segment rewards.
   Tiny model (16 x (32 + 128) tokens) and the SmolLM2-135M architecture (8 x (32 + 128)). Target <= 1.005x.

    python benchmarks/entropy_fused.py [--quick] [--rounds N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from _timing import interleaved, machine_probe, one_thread, paired_ratio, summary_row  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = "<= 1.005x"


def old_token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """rlhf-ext's ``token_entropy(shift=False)`` before this change (1M-logit chunks, normalise, mask, sum)."""
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    rows = max(1, (1 << 20) // v)
    out = torch.empty(b * t)
    for start in range(0, b * t, rows):
        z = flat[start : start + rows].float()
        logz = torch.logsumexp(z, dim=-1, keepdim=True)
        p = torch.exp(z - logz)
        pz = torch.where(p > 0, p * z, torch.zeros_like(z))
        out[start : start + rows] = (logz.squeeze(-1) - pz.sum(-1)).clamp_min_(0.0)
    return out.view(b, t)


def _ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def kernel(rounds: int) -> dict:
    from rlhf_ext.algos.segment_reward import logprobs_and_entropy
    from rlhf_ext.openrlhf.compat import import_shims

    with import_shims():
        from openrlhf.models.utils import compute_entropy, log_probs_from_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 24, 49152, generator=g) * 3
    labels = torch.randint(0, 49152, (4, 24), generator=g)
    times = interleaved(
        {
            "fused": lambda: logprobs_and_entropy(logits, labels),
            "openrlhf_log_probs": lambda: log_probs_from_logits(logits, labels),
            "openrlhf_compute_entropy": lambda: compute_entropy(logits),
            "old_token_entropy": lambda: old_token_entropy(logits),
        },
        rounds,
    )
    return {"shape": [4, 24, 49152], "ms": _ms(times),
            "ratio_vs_log_probs_alone": paired_ratio(times, "fused", "openrlhf_log_probs"),
            "ratio_vs_compute_entropy": paired_ratio(times, "fused", "openrlhf_compute_entropy"),
            "ratio_vs_old_token_entropy": paired_ratio(times, "fused", "old_token_entropy")}  # fmt: skip


def openrlhf_make_experience(smol: str, rounds: int, prompt: int = 32, actions: int = 24, batch: int = 4) -> dict:
    """Stock vs segment make_experience forwards + reward production, OpenRLHF's models called in-process."""
    import rlhf_ext.openrlhf.segment_ppo as seg_ppo
    from rlhf_ext.openrlhf.compat import import_shims
    from rlhf_ext.runtime.token_scores import TokenScoreCapture

    with import_shims():
        from openrlhf.models import Actor
        from openrlhf.models.model import _get_reward_model
        from openrlhf.trainer.ppo_utils.experience import Experience
        from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
    from transformers import AutoConfig, LlamaModel, LlamaPreTrainedModel

    seg_ppo.install_in_process()
    torch.manual_seed(0)
    ref = Actor(smol, attn_implementation="sdpa", param_dtype="bf16").float().eval()
    policy = Actor(smol, attn_implementation="sdpa", param_dtype="bf16").float().eval()
    config = AutoConfig.from_pretrained(smol)
    config.normalize_reward = False
    rm = _get_reward_model(LlamaPreTrainedModel, LlamaModel, "score", packing_samples=False)(config).eval()
    strategy = SimpleNamespace(ring_attn_group=None, args=SimpleNamespace(ds=SimpleNamespace(packing_samples=False)))
    seg_ref = seg_ppo._SegmentReferenceActor.__new__(seg_ppo._SegmentReferenceActor)
    seg_ref.model, seg_ref.strategy = ref, strategy
    seg_rm = seg_ppo._SegmentRewardActor.__new__(seg_ppo._SegmentRewardActor)
    seg_rm.model, seg_rm.strategy, seg_rm._capture = rm, strategy, TokenScoreCapture(rm)
    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="gae", gamma=1.0, lambd=0.95, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=1, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=None, model_name_or_path=None), data=SimpleNamespace(max_len=128),
        ext=SimpleNamespace(granularity="segment", interpolation="even_split", entropy_cutoff=2.0,
                            aggregation="softmax", tau=0.5, normalizer=None, reward_model_id=None, chunk_size=4),
    )  # fmt: skip
    maker = seg_ppo.SegmentExperienceMaker(
        None, None, None, None, FixedKLController(0.01), SimpleNamespace(args=args), tokenizer=None
    )
    g = torch.Generator().manual_seed(1)
    t = prompt + actions
    sequences = torch.randint(3, config.vocab_size, (batch, t), generator=g)
    attention_mask = torch.ones(batch, t, dtype=torch.long)
    attention_mask[0, :4] = 0  # a left-padded prompt
    action_mask = torch.ones(batch, actions, dtype=torch.bool)
    action_mask[1, 18:] = False  # a shorter response (its tail is padding)
    attention_mask[1, prompt + 18 :] = 0

    @torch.no_grad()
    def stock():
        base = ref(sequences, action_mask, attention_mask)
        log_probs = policy(sequences, action_mask, attention_mask)
        reward = rm(sequences, attention_mask)
        return base, log_probs, reward

    @torch.no_grad()
    def segment():
        base, entropy = seg_ref.forward(sequences, action_mask, attention_mask)
        log_probs = policy(sequences, action_mask, attention_mask)
        exp = Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                         kl=(log_probs - base) * action_mask, info={})  # fmt: skip
        exp.rewards = seg_rm.forward(sequences, attention_mask)
        maker.attach_dense_rewards([exp], [entropy])
        return exp

    times = interleaved({"stock": stock, "segment": segment}, rounds)
    return {"models": "SmolLM2-135M (builtin:smollm2), fp32", "batch": batch, "prompt_tokens": prompt,
            "action_tokens": actions, "ms": _ms(times), "ratio": paired_ratio(times, "segment", "stock")}  # fmt: skip


def reward_trainer(policy_dir: str, rm_dir: str, batch: int, completion: int):
    """The ``SegmentPPOTrainer`` (REINFORCE, no normaliser, entropy cutoff 2.0, CPU) whose reward path the TRL
    reward-cost benchmarks time (here and ``segment_ppo.py``)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from rlhf_ext.trl.segment_ppo import SegmentPPOConfig, SegmentPPOTrainer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    with tempfile.TemporaryDirectory() as tmp:
        args = SegmentPPOConfig(
            output_dir=tmp, reward_model_path=rm_dir, granularity="segment", advantage_estimator="reinforce",
            normalizer_kind="none",
            per_device_train_batch_size=batch, num_generations=2, max_completion_length=completion, bf16=False,
            use_cpu=True, report_to="none", gradient_checkpointing=False, entropy_cutoff=2.0,
        )  # fmt: skip
        return SegmentPPOTrainer(
            model=policy_dir, args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * 4), processing_class=tok
        )


def trl_reward_cost(label: str, policy_dir: str, rm_dir: str, batch: int, completion: int, rounds: int) -> dict:
    """Stock bandit (TRL's fused head on the reference model) vs segment reward production for one PPO batch."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from rlhf_ext.runtime.token_scores import position_scores
    from rlhf_ext.segment import LocationNormalizer, dense_segment_rewards

    trainer = reward_trainer(policy_dir, rm_dir, batch, completion)
    stock_ref = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    add_fused_lm_head(stock_ref, temperature=trainer.temperature)  # what TRL's own trainers put on a reference model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, trainer.model.config.vocab_size, (batch, 32 + completion), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.ones(batch, completion, dtype=torch.bool)
    norm = LocationNormalizer(kind="global", b_mu=0.1, b_sigma=0.2)
    logps = trainer._get_per_token_logps_and_entropies

    @torch.no_grad()
    def stock():
        logps(stock_ref, ids, attn, completion)
        scores = position_scores(trainer._reward_capture, trainer.reward_model, ids, attn)[:, -completion:]
        return dense_segment_rewards(scores, mask, normalizer=norm, granularity="bandit").rewards

    @torch.no_grad()
    def segment():
        _, ent, _ = logps(trainer.segment_ref_model, ids, attn, completion, compute_entropy=True)
        scores = position_scores(trainer._reward_capture, trainer.reward_model, ids, attn)[:, -completion:]
        return dense_segment_rewards(scores, mask, ent, normalizer=norm, entropy_cutoff=2.0).rewards

    stock_ref_entropy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    add_fused_lm_head(stock_ref_entropy, temperature=trainer.temperature, outputs=("log_probs", "entropy"))

    def reference(model, entropy: bool):  # the reference forward alone, no-grad as in the rollout
        return torch.no_grad()(lambda: logps(model, ids, attn, completion, compute_entropy=entropy))

    times = interleaved(
        {"stock": stock, "segment": segment, "ref_trl_head_log_probs": reference(stock_ref, False),
         "ref_trl_head_with_entropy": reference(stock_ref_entropy, True),
         "ref_ours_with_entropy": reference(trainer.segment_ref_model, True)},
        rounds,
    )  # fmt: skip
    return {"models": label, "batch": batch, "prompt_tokens": 32, "completion": completion, "ms": _ms(times),
            "ratio": paired_ratio(times, "segment", "stock"),
            "reference_forward_ratio_ours_vs_trl_head_log_probs_only": paired_ratio(
                times, "ref_ours_with_entropy", "ref_trl_head_log_probs"),
            "reference_forward_ratio_trl_head_with_vs_without_entropy": paired_ratio(
                times, "ref_trl_head_with_entropy", "ref_trl_head_log_probs")}  # fmt: skip


def smollm2_arch_dirs(smol: str, tmp: str) -> tuple[str, str]:
    """SmolLM2-135M architecture for policy/reference and a segment RM (random weights: costs, not quality)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    cfg = AutoConfig.from_pretrained(smol)
    pol, rmd = Path(tmp) / "policy", Path(tmp) / "rm"
    AutoModelForCausalLM.from_pretrained(smol).save_pretrained(pol)
    cfg.num_labels = 1
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rmd)
    for d in (pol, rmd):
        AutoTokenizer.from_pretrained(smol).save_pretrained(d)
    settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5, "sft_model_name_or_path": str(pol)}
    (rmd / "segment_config.json").write_text(json.dumps(settings))
    return str(pol), str(rmd)


def fmt(r: dict) -> str:
    return f"{r['median']:.3f}x [{r['p25']:.3f}-{r['p75']:.3f}] n={r['n']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, tiny TRL model only (a few minutes)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per figure (default 15; --quick 5)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/entropy_fused[_quick].json")
    parser.add_argument(
        "--update-openrlhf-json",
        action="store_true",
        help="write the in-process ratio into benchmarks/results/openrlhf_ppo_smollm2.json",
    )
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 15)
    sys.path.insert(0, str(ROOT))
    one_thread()
    from rlhf_ext.pipelines.builtins import resolve_model

    smol = resolve_model("builtin:smollm2")
    results: dict = {"rounds": rounds, "machine": machine_probe()}
    results["kernel"] = k = kernel(rounds)
    print("kernel [4, 24, 49152] ms:", {n: round(v, 2) for n, v in k["ms"].items()})
    print(
        "  fused / log-probs alone",
        fmt(k["ratio_vs_log_probs_alone"]),
        "| / compute_entropy",
        fmt(k["ratio_vs_compute_entropy"]),
        "| / old token_entropy",
        fmt(k["ratio_vs_old_token_entropy"]),
    )
    results["openrlhf"] = o = openrlhf_make_experience(smol, rounds)
    print("OpenRLHF make_experience segment / stock:", fmt(o["ratio"]), {n: round(v, 1) for n, v in o["ms"].items()})
    results["trl"] = [trl_reward_cost("tiny policy + tiny RM", resolve_model("builtin:tiny-sft"),
                                      resolve_model("builtin:tiny-segment-rm"), 16, 128, rounds)]  # fmt: skip
    if not args.quick:
        with tempfile.TemporaryDirectory() as tmp:
            pol, rmd = smollm2_arch_dirs(smol, tmp)
            results["trl"].append(trl_reward_cost("SmolLM2-135M (x2)", pol, rmd, 8, 128, rounds))
    for r in results["trl"]:
        print(
            f"TRL {r['models']}: segment / stock bandit {fmt(r['ratio'])}", {n: round(v, 1) for n, v in r["ms"].items()}
        )
    machine = machine_probe()
    results["machine_after"] = machine
    summary = [
        summary_row("OpenRLHF make_experience, segment vs stock, SmolLM2-135M (in-process)", "segment forwards + "
                    "dense rewards", "stock OpenRLHF forwards + scalar reward", o["ratio"], TARGET, machine),
        summary_row("entropy kernel [4, 24, 49152] vs OpenRLHF compute_entropy", "logprobs_and_entropy "
                    "(log-probs + entropy)", "compute_entropy (entropy only, eager)", k["ratio_vs_compute_entropy"],
                    "< 1x", machine),
    ]  # fmt: skip
    for r in results["trl"]:
        summary.append(summary_row(f"segment reward production vs stock bandit, one PPO batch (TRL), {r['models']}",
                                   "segment", "bandit, TRL's fused head", r["ratio"], TARGET, machine))  # fmt: skip
    results["summary"] = summary
    out = Path(args.out or f"benchmarks/results/entropy_fused{'_quick' if args.quick else ''}.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    if args.update_openrlhf_json:
        path = ROOT / "benchmarks" / "results" / "openrlhf_ppo_smollm2.json"
        data = json.loads(path.read_text())
        step = data["step_cost"]
        if "ratio_make_experience_ray_smoke" not in step:
            step["ratio_make_experience_ray_smoke"] = step["ratio_make_experience"]
        step["ratio_make_experience"] = o["ratio"]["median"]
        step["ratio_make_experience_in_process"] = {**o["ratio"], "source": "benchmarks/entropy_fused.py", **{
            k2: o[k2] for k2 in ("batch", "prompt_tokens", "action_tokens")}}  # fmt: skip
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"updated {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
