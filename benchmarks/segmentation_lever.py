"""How much of a segment-PPO return is bought by segmentation: summed dense rewards of fixed responses re-scored under
perturbed segmentations (paper 003's mode vs ``chunk``).

For a finished simulator PPO run (its reward model and fitted normalizer) and the seed's SFT model, this draws responses
from the SFT model and from the trained policy on the evaluation prompts, scores every prefix with the reward model,
and sums the normalized, interpolated rewards of each response under:

* ``segment`` at the entropy cutoff the reward model was trained with, at lower cutoffs (more boundaries: what a
  policy gets by writing text the SFT model finds less predictable) and with every boundary moved one token later
  (the same count, other reading positions);
* ``chunk`` (fixed ``--chunk-size`` segments), whose sum cannot move with the entropies by construction
  (``tests/algos/test_segment_dense_and_ppo.py`` checks that on random inputs; this reports it on real ones).

The difference between a perturbed and the reference segmentation, for the *same* texts, is reward the policy could buy
without changing what the reward model reads. Writes ``--out`` (JSON) and prints a Markdown table.

    python benchmarks/segmentation_lever.py --run runs/sim/seed-0/segment_ppo --sft runs/sim/sft \\
        --reward-model runs/sim/seed-0/rm_segment --prompts-from runs/sim
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def summed_rewards(scores, mask, entropy, normalizer, granularity, cutoff, chunk_size):
    from rlhf_ext.algos.segment_dense import dense_segment_rewards

    return dense_segment_rewards(
        scores, mask, entropy, normalizer=normalizer, granularity=granularity, entropy_cutoff=cutoff,
        chunk_size=chunk_size,
    ).sequence_reward  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished PPO output directory (policy + normalizer.json)")
    parser.add_argument("--sft", required=True)
    parser.add_argument("--reward-model", required=True)
    parser.add_argument("--prompts-from", required=True, help="a sim compare directory (its evaluation prompts)")
    parser.add_argument("--cutoffs", type=float, nargs="+", default=[1.5, 1.0, 0.5])
    parser.add_argument("--chunk-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForSequenceClassification

    from rlhf_ext.config import from_dict
    from rlhf_ext.runtime.calibration import load_normalizer
    from rlhf_ext.runtime.segment_data import load_segment_settings
    from rlhf_ext.runtime.token_scores import token_scores
    from rlhf_ext.sim.compare import SimRun
    from rlhf_ext.sim.recipe import SimCompareRecipe

    torch.set_num_threads(1)
    source = Path(args.prompts_from)
    settings = json.loads((source / "recipe.json").read_text())["settings"]
    run = SimRun(from_dict(SimCompareRecipe, {**settings, "output_dir": str(source)}))
    prompts = run.eval_prompts()
    normalizer = load_normalizer(Path(args.run) / "normalizer.json")
    cutoff = load_segment_settings(args.reward_model)["entropy_cutoff"]
    rm = AutoModelForSequenceClassification.from_pretrained(args.reward_model, num_labels=1).eval()
    sft = run.policy(args.sft)
    rows = {}
    for name, path in (("SFT samples", args.sft), ("policy samples", args.run)):
        samples = run.policy(path).sample(prompts, args.samples, seed=123)
        flat = [p for p in prompts for _ in range(args.samples)]
        sums: dict[str, list[float]] = {}
        for batch in _batches(sft, flat, samples):
            ids, attention, response, entropy = batch
            with torch.no_grad():
                scores = token_scores(rm, ids, attention)[:, 1:].float()  # aligned with the response tokens
            reference = summed_rewards(scores, response, entropy, normalizer, "segment", cutoff, args.chunk_size)
            variants = {f"segment, cutoff {cutoff:g} (reference)": reference}
            for c in args.cutoffs:
                variants[f"segment, cutoff {c:g}"] = summed_rewards(
                    scores, response, entropy, normalizer, "segment", c, args.chunk_size
                )
            moved = torch.roll(entropy, 1, dims=1)  # every boundary one token later
            variants["segment, boundaries moved +1 token"] = summed_rewards(
                scores, response, moved, normalizer, "segment", cutoff, args.chunk_size
            )
            chunk = summed_rewards(scores, response, entropy, normalizer, "chunk", cutoff, args.chunk_size)
            variants[f"chunk {args.chunk_size}"] = chunk
            variants[f"chunk {args.chunk_size}, cutoff {min(args.cutoffs):g}"] = summed_rewards(
                scores, response, entropy, normalizer, "chunk", min(args.cutoffs), args.chunk_size
            )
            for key, value in variants.items():
                sums.setdefault(key, []).extend((value - (chunk if key.startswith("chunk") else reference)).tolist())
                sums.setdefault(f"{key} | sum", []).extend(value.tolist())
        rows[name] = {
            key: {"mean": statistics.fmean(v), "se": statistics.stdev(v) / math.sqrt(len(v))} for key, v in sums.items()
        }
    lines = ["| responses | segmentation | summed reward | change vs reference |", "|---|---|---|---|"]
    for name, stats in rows.items():
        for key in [k for k in stats if not k.endswith("| sum")]:
            total, delta = stats[f"{key} | sum"], stats[key]
            change = f"{delta['mean']:+.2f} ± {delta['se']:.2f}"
            lines.append(f"| {name} | {key} | {total['mean']:+.2f} ± {total['se']:.2f} | {change} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "table": lines}, indent=1) + "\n")


def _batches(sft, prompts, samples, batch_size: int = 16):
    """``(ids [B, T], attention [B, T], response mask [B, T-1], SFT entropy [B, T-1])`` per batch, tokenised as the
    simulator's policies tokenise (prompt, response, EOS unless truncated); position t-1 of the masks is token t."""
    import torch

    from rlhf_ext.algos.segment_reward import token_entropy
    from rlhf_ext.runtime.sampling import encode_prompts
    from rlhf_ext.runtime.segment_data import pad_sequences

    tok = sft.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    prompt_ids = encode_prompts(tok, prompts, None)
    seqs, starts = [], []
    for p, text, cut in zip(prompt_ids, samples.flat(), samples.truncated.flatten().tolist()):
        r = tok(text, add_special_tokens=False)["input_ids"] if text else []
        seqs.append(p + r + ([] if cut else [eos]))
        starts.append(len(p))
    for lo in range(0, len(seqs), batch_size):
        chunk, first = seqs[lo : lo + batch_size], starts[lo : lo + batch_size]
        ids = pad_sequences(chunk, pad, "right", torch.long)
        lengths = torch.tensor([len(s) for s in chunk])
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        attention = (pos < lengths.unsqueeze(1)).long()
        with torch.no_grad():
            logits = sft.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / sft.temperature
        target = pos[:, 1:]
        response = (target >= torch.tensor(first).unsqueeze(1)) & (target < lengths.unsqueeze(1))
        yield ids, attention, response, token_entropy(logits, shift=False)


if __name__ == "__main__":
    main()
