"""Log-probs + entropies of a reference forward's logits on a CUDA device: ``logprobs_and_entropy`` at several chunk
sizes next to what OpenRLHF computes there (log-probs by ``logsumexp``, then ``compute_entropy``'s softmax pass).

    python benchmarks/entropy_gpu.py [--shape 8 1024 151936] [--dtype bfloat16] [--reps 10] [--out FILE]

GPU time by CUDA events (median over ``--reps`` after 2 warm-ups) and the peak memory each contender allocates
beyond its input. OpenRLHF's own functions are used when it is installed; otherwise the same formulas
(``openrlhf.models.utils``: ``gather - logsumexp`` in fp32, ``logsumexp - sum(softmax * logits)``), labelled so.
Needs CUDA; ``--help`` runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[8, 1024, 151936], metavar=("B", "T", "V"))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/entropy_gpu.json")
    args = parser.parse_args()

    import torch

    from rlhf_ext.algos.segment_reward import logprobs_and_entropy

    if not torch.cuda.is_available():
        raise SystemExit("entropy_gpu.py needs a CUDA device")
    try:
        from openrlhf.models.utils import compute_entropy, log_probs_from_logits

        stock = "openrlhf"
    except ImportError:
        stock = "openrlhf formulas (not installed)"

        def log_probs_from_logits(logits, labels):
            z = logits.float()
            return z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)

        def compute_entropy(logits):
            pd = torch.nn.functional.softmax(logits, dim=-1)
            return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)

    b, t, v = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(b, t, v, device="cuda", generator=g) * 3).to(getattr(torch, args.dtype))
    labels = torch.randint(0, v, (b, t), device="cuda", generator=g)
    contenders = {
        "stock log-probs": lambda: log_probs_from_logits(logits, labels),
        "stock log-probs + compute_entropy": lambda: (log_probs_from_logits(logits, labels), compute_entropy(logits)),
    }
    for elements in (1 << 18, 1 << 22, 1 << 24, 1 << 26):
        rows = max(2, elements // v)
        contenders[f"ours, {elements / 2**20:g}M-logit chunks"] = lambda rows=rows: logprobs_and_entropy(
            logits, labels, chunk_size=rows
        )
    contenders["ours, default chunks"] = lambda: logprobs_and_entropy(logits, labels)
    results = {}
    for name, fn in contenders.items():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        results[name] = {"ms_median": statistics.median(times), "ms": times,
                         "peak_extra_mb": (torch.cuda.max_memory_allocated() - base) / 2**20}  # fmt: skip
        print(f"{name:<40} {results[name]['ms_median']:9.2f} ms  peak +{results[name]['peak_extra_mb']:8.0f} MB")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "stock": stock,
           "shape": args.shape, "dtype": args.dtype, "reps": args.reps, "results": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
