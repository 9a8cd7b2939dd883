"""Does the location-aware normalizer centre every location on responses it was not fitted on? (paper 003, Eq. 6)

For one seed of a simulator comparison directory (``rlhf-ext sim compare``; its SFT model, simulated feedback and
segment reward model are built on first use), this collects the segment rewards that segment PPO's normalizer sees:

* **calibration**: the first 256 training pairs of the feedback (chosen and rejected), exactly what the simulator's
  PPO fits its normalizer on (``data.calibration``, ``max_calibration_pairs: 256``);
* **held out**: two SFT samples per evaluation prompt (sampling seed 123), tokenised as the simulator's policies write.

Each response is segmented with the SFT model at the reward model's entropy cutoff and scored at every segment end.
The points go to ``--out`` (gzipped JSON: per response its segment count ``T`` and raw segment rewards, so each
location is ``p = t / T`` exactly), which ``tests/algos/test_normalizer_centring.py`` fits and checks; the script prints
the mean normalized reward per location bucket for the package's fit.

    python benchmarks/normalizer_centring.py --sim-dir runs/sim --seed 0 \\
        --out tests/fixtures/normalizer_centring/seed0.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

CALIBRATION_PAIRS = 256
LOCATION_BUCKETS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0))


def responses(dense) -> list[dict]:
    """``[{"T": segments, "rewards": [raw segment reward per segment]}]`` per response of one scored batch."""
    counts, rewards, mask = dense.segments.counts, dense.raw_seg_rewards, dense.segments.mask
    return [
        {"T": int(n), "rewards": [float(f"{r:.7g}") for r in rewards[b][mask[b]].tolist()]}
        for b, n in enumerate(counts.tolist())
        if n > 0
    ]


def points(rows: list[dict]):
    """``(p [N] float64, r [N] float64)``: every segment's location ``t / T`` and raw reward."""
    import torch

    p = [t / row["T"] for row in rows for t in range(1, row["T"] + 1)]
    r = [x for row in rows for x in row["rewards"]]
    return torch.tensor(p, dtype=torch.float64), torch.tensor(r, dtype=torch.float64)


def bucket_means(normalizer, rows: list[dict]) -> dict[str, float]:
    """Mean normalized reward of ``rows``' segments per location bucket (the last segment excluded) and at p = 1."""
    p, r = points(rows)
    z = normalizer.normalize(r, p)
    out = {}
    for lo, hi in LOCATION_BUCKETS:
        name = f"{lo:g} < p <= {hi:g}" if hi < 1 else f"{lo:g} < p < 1"
        out[name] = float(z[(p > lo) & (p <= hi) & (p < 1)].mean())
    out["p = 1"] = float(z[p == 1].mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim-dir", required=True, help="a sim compare output directory (built on first use)")
    parser.add_argument("--config", default="sim_compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_ext.algos.location_norm import LocationNormalizer
    from rlhf_ext.algos.segment_dense import dense_segment_rewards
    from rlhf_ext.recipes import recipe_path
    from rlhf_ext.runtime.segment_data import collate_segment_pairs, prepare_segment_dataset, resolve_segment_settings
    from rlhf_ext.runtime.token_scores import token_scores
    from rlhf_ext.sim.compare import SimRun
    from rlhf_ext.sim.recipe import load_compare_recipe

    sys.path.insert(0, str(Path(__file__).parent))
    from segmentation_lever import _batches

    torch.set_num_threads(1)
    overrides = [f"output_dir={args.sim_dir}", f"seeds=[{args.seed}]"]
    recipe = load_compare_recipe(recipe_path(args.config), overrides, None)
    run = SimRun(recipe, progress=lambda m: print(m, file=sys.stderr))
    run.check_directory()
    sft_path, rm_path = run.sft_model(), run.reward_model(args.seed, "segment")
    cutoff, aggregation, tau = resolve_segment_settings(rm_path)
    knobs = {"entropy_cutoff": cutoff, "aggregation": aggregation, "tau": tau}
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    calibration: list[dict] = []
    pairs = run.feedback(args.seed)["train"].select(range(CALIBRATION_PAIRS))
    sft_lm = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    prepared = prepare_segment_dataset(pairs, tokenizer, sft_model=sft_lm, max_length=recipe.task.max_length)
    with torch.no_grad():
        for lo in range(0, len(prepared), 16):
            batch = collate_segment_pairs(list(prepared.select(range(lo, min(lo + 16, len(prepared))))), pad)
            scores = token_scores(reward_model, batch["input_ids"], batch["attention_mask"])
            calibration += responses(dense_segment_rewards(scores, batch["action_mask"], batch["entropy"], **knobs))

    held_out: list[dict] = []
    sft, prompts = run.policy(sft_path), run.eval_prompts()
    samples = sft.sample(prompts, 2, seed=123)
    with torch.no_grad():
        for ids, attention, response, entropy in _batches(sft, [p for p in prompts for _ in range(2)], samples):
            scores = token_scores(reward_model, ids, attention)[:, 1:].float()
            held_out += responses(dense_segment_rewards(scores, response, entropy, **knobs))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"seed": args.seed, "settings": knobs, "calibration": calibration, "held_out": held_out}
    with gzip.open(out, "wt") as f:
        json.dump(data, f, separators=(",", ":"))
    normalizer = LocationNormalizer.fit(*points(calibration))
    print("| location | calibration | held out |\n|---|---|---|")
    cal, held = bucket_means(normalizer, calibration), bucket_means(normalizer, held_out)
    for key in cal:
        print(f"| {key} | {cal[key]:+.3f} | {held[key]:+.3f} |")


if __name__ == "__main__":
    main()
