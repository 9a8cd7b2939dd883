"""On-disk store of the preference pairs collected by iterative online DPO: one dataset per iteration.

Layout under ``root``::

    iter_000/pairs.jsonl      one JSON object per pair (prompt, chosen, rejected, rewards, indices ...)
    iter_000/summary.json     what the collection step measured (pairs kept, dropped, mean reward ...)
    iter_001/...

Each iteration directory is written atomically (:func:`~rlhf_ext.runtime.io.atomic_directory`) and never twice (the
trainer checks :meth:`PairStore.has` first), so a resumed run loses and duplicates no pair.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from rlhf_ext.runtime.io import atomic_directory, atomic_write_json

PAIRS_FILE = "pairs.jsonl"
SUMMARY_FILE = "summary.json"

PairData = Literal["accumulate", "latest"]


class PairStore:
    """Per-iteration preference pairs under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, iteration: int) -> Path:
        return self.root / f"iter_{iteration:03d}"

    def has(self, iteration: int) -> bool:
        return (self.path(iteration) / SUMMARY_FILE).is_file()

    def completed(self) -> list[int]:
        """Iterations whose pairs are on disk, in order."""
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.iterdir() if p.name.startswith("iter_") and (p / SUMMARY_FILE).is_file()]
        return sorted(int(p.name[len("iter_") :]) for p in done if p.is_dir())

    def write(self, iteration: int, rows: list[dict[str, Any]], summary: dict[str, Any]) -> Path:
        """Write iteration ``iteration``'s pairs atomically; refuses to overwrite a completed iteration."""
        if self.has(iteration):
            raise FileExistsError(
                f"pairs of iteration {iteration} already exist in {self.path(iteration)}; a finished iteration is "
                "never rewritten (delete the directory to collect it again)"
            )
        with atomic_directory(self.path(iteration)) as tmp:
            text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
            (tmp / PAIRS_FILE).write_text(text)
            atomic_write_json(tmp / SUMMARY_FILE, {**summary, "iteration": iteration, "num_pairs": len(rows)})
        return self.path(iteration)

    def read(self, iteration: int) -> list[dict[str, Any]]:
        if not self.has(iteration):
            raise FileNotFoundError(f"no pairs for iteration {iteration} in {self.root}")
        lines = (self.path(iteration) / PAIRS_FILE).read_text().splitlines()
        return [json.loads(line) for line in lines if line]

    def summary(self, iteration: int) -> dict[str, Any]:
        return json.loads((self.path(iteration) / SUMMARY_FILE).read_text())

    def training_pairs(self, iteration: int, pair_data: PairData = "accumulate") -> list[dict[str, Any]]:
        """The pairs iteration ``iteration`` trains on: all iterations ``0..iteration`` in order (``accumulate``, the
        paper's "historical + new") or only its own (``latest``)."""
        if pair_data not in ("accumulate", "latest"):
            raise ValueError(f"pair_data must be 'accumulate' or 'latest', got {pair_data!r}")
        its = range(iteration + 1) if pair_data == "accumulate" else [iteration]
        return [row for it in its for row in self.read(it)]
