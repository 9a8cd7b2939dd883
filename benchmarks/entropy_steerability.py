"""Would a stronger model's entropy boundaries be hard to steer? Paper 003's segmentation read by two models on the
same texts.

In the simulator, segment PPO in paper mode learns to write text that its tiny SFT model (2 layers, hidden 64)
segments ever more finely: most of the policy's tokens end up above the entropy cutoff, and each extra boundary
pays (``docs/segment_ppo_evidence.md``). This benchmark asks whether that is a weakness of the tiny segmenter or a
property of the text: it samples responses to the same held-out prompts from the SFT model and from the final
policies of a finished comparison, then measures the segmentation of every set (share of response tokens above the
cutoff, boundaries per response; :meth:`rlhf_ext.sim.evaluate.HFPolicy.segmentation`) under the comparison's SFT
model and under SmolLM2-135M (``builtin:smollm2``, a real pretrained model, each with its own tokenizer). SmolLM2 is
not fine-tuned on the task here (its fine-tuning does not fit a 2-core CPU budget), so its absolute shares are not
those a SmolLM2 SFT model would give; what it shows is whether the policies' text is more uncertain than SFT text to
a model that did not shape it.

Usage::

    python benchmarks/entropy_steerability.py --from runs/sim_compare --seeds 1,2,3 --prompts 64

Writes ``benchmarks/results/entropy_steerability.json`` (per seed, text set and model) and prints a markdown table of
means over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

CUTOFF = 2.0  # paper 003's entropy cutoff, the comparison's
SETS = ("sft", "bandit_ppo", "segment_ppo", "chunk_ppo", "token_ppo")


def response_entropies(model, prompts, texts, truncated):
    """The entropy (nats, at temperature 1) of every response token's next-token distribution under ``model`` (an
    :class:`~rlhf_ext.sim.evaluate.HFPolicy`), as one flat list, and the token count of each response."""
    import torch

    flat, counts = [], []
    with torch.no_grad():
        for ids, attention, response in model._batches(prompts, texts, truncated):
            logp = model._log_softmax(ids, attention)
            entropy = -(logp.exp() * logp).sum(-1)
            flat += entropy[response].tolist()
            counts += response.sum(1).tolist()
    return flat, counts


def main() -> None:
    import numpy as np
    import torch
    from datasets import load_from_disk

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.sim.evaluate import HFPolicy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="run", required=True, help="a finished `sim compare` output directory")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/entropy_steerability.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    run = Path(args.run)
    prompts = load_from_disk(str(run / "data"))["eval"]["prompt"][: args.prompts]
    readers = {"sft (tiny)": HFPolicy(str(run / "sft"), temperature=1.0),
               "SmolLM2-135M": HFPolicy(resolve_model("builtin:smollm2"), temperature=1.0)}  # fmt: skip
    entropies: dict[tuple[int, str, str], list[float]] = {}
    rows = []
    for seed in map(int, args.seeds.split(",")):
        for name in SETS:
            path = run / "sft" if name == "sft" else run / f"seed-{seed}" / name
            if not (path / "config.json").exists():
                continue
            samples = HFPolicy(str(path), temperature=1.0, max_new_tokens=128).sample(prompts, n=1, seed=seed)
            texts, truncated = samples.flat(), samples.truncated.flatten()
            for reader, model in readers.items():
                flat, counts = response_entropies(model, prompts, texts, truncated)
                entropies[seed, name, reader] = flat
                rows.append({"seed": seed, "text": name, "reader": reader,
                             "tokens_per_response": float(np.mean(counts)), "mean_entropy": float(np.mean(flat)),
                             "above_cutoff_share": float(np.mean(np.array(flat) > CUTOFF))})  # fmt: skip
    # each reader's cutoff at the operating point of the comparison's segmenter on SFT text: the share of SFT-sample
    # tokens the tiny SFT model puts above 2.0, read off the reader's own entropies of the same SFT samples
    for seed in {r["seed"] for r in rows}:
        target = next(
            r["above_cutoff_share"] for r in rows if (r["seed"], r["text"], r["reader"]) == (seed, "sft", "sft (tiny)")
        )
        for reader in readers:
            cutoff = float(np.quantile(entropies[seed, "sft", reader], 1 - target))
            for r in rows:
                if (r["seed"], r["reader"]) == (seed, reader):
                    r["matched_cutoff"] = cutoff
                    r["above_matched_cutoff_share"] = float(
                        np.mean(np.array(entropies[seed, r["text"], reader]) > cutoff)
                    )
    for r in rows:
        print(json.dumps(r), flush=True)
    Path(args.out).write_text(json.dumps({"cutoff": CUTOFF, "prompts": args.prompts, "run": str(run), "rows": rows},
                                         indent=1))  # fmt: skip
    print(
        "\n| text (policy) | reader | mean entropy (nats) | share above 2.0 | share above the matched cutoff | tokens |"
    )
    print("|---|---|---|---|---|---|")
    for name in SETS:
        for reader in readers:
            sel = [r for r in rows if r["text"] == name and r["reader"] == reader]
            if sel:
                matched = [r["above_matched_cutoff_share"] for r in sel]
                print(f"| {name} | {reader} | {np.mean([r['mean_entropy'] for r in sel]):.2f} "
                      f"| {np.mean([r['above_cutoff_share'] for r in sel]):.3f} "
                      f"| {np.mean(matched):.3f} ({' / '.join(f'{m:.2f}' for m in matched)}) "
                      f"| {np.mean([r['tokens_per_response'] for r in sel]):.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
