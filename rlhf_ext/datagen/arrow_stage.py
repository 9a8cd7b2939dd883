"""Stage splits written row by row, in the files ``datasets.Dataset.save_to_disk`` writes, without ``datasets``.

A split directory holds ``data-00000-of-00001.arrow`` (an Arrow IPC stream of :data:`BATCH_ROWS`-row batches),
``dataset_info.json`` and ``state.json``; a stage directory adds ``dataset_dict.json``. The files are byte-identical
to ``save_to_disk``'s for a split of at most one batch; a longer split differs only in buffer padding, and
``state.json``'s ``_fingerprint`` is the Arrow file's sha256. Memory is one batch per open split.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

ARROW_FILE = "data-00000-of-00001.arrow"
#: rows per record batch: ``save_to_disk``'s ``writer_batch_size`` for rows under 100 KB
BATCH_ROWS = 1000
_TEXT = {"dtype": "string", "_type": "Value"}
_COLUMNS = ("prompt", "chosen", "rejected", "source_task", "style", "seed_words", "sample_id", "swapped")


def feature_dict(fmt: str) -> dict[str, Any]:
    """The ``datasets.Features.to_dict()`` of a stage split in format ``plain`` or ``conversational``."""
    if fmt == "plain":
        text = _TEXT
    elif fmt == "conversational":
        text = {"feature": {"role": _TEXT, "content": _TEXT}, "_type": "List"}
    else:
        raise ValueError(f"unknown format {fmt!r}; choose plain or conversational")
    return {
        "prompt": text,
        "chosen": text,
        "rejected": text,
        "source_task": _TEXT,
        "style": _TEXT,
        "seed_words": {"feature": _TEXT, "_type": "List"},
        "sample_id": _TEXT,
        "swapped": {"dtype": "bool", "_type": "Value"},
    }


def arrow_schema(fmt: str):
    """The ``pyarrow.Schema`` of a stage split (``datasets.Features.arrow_schema`` of :func:`feature_dict`)."""
    import pyarrow as pa

    text = pa.string()
    if fmt == "conversational":
        text = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    fields = [(c, text) for c in _COLUMNS[:3]] + [("source_task", pa.string()), ("style", pa.string())]
    fields += [("seed_words", pa.list_(pa.string())), ("sample_id", pa.string()), ("swapped", pa.bool_())]
    meta = {"info": {"features": feature_dict(fmt)}}
    return pa.schema(fields).with_metadata({"huggingface": json.dumps(meta)})


class SplitWriter:
    """Write one split directory row by row (:meth:`add`), :data:`BATCH_ROWS` rows per record batch; :meth:`close`
    writes the JSON files and returns the row count."""

    def __init__(self, directory: Path, fmt: str):
        import pyarrow as pa

        self.directory = Path(directory)
        self.directory.mkdir(parents=True)
        self.fmt = fmt
        self.schema = arrow_schema(fmt)
        self.rows = 0
        self._batch: dict[str, list] = {c: [] for c in _COLUMNS}
        self._sink = pa.OSFile(str(self.directory / ARROW_FILE), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)

    def add(self, row: dict[str, Any]) -> None:
        """Append a plain-text row (converted to the writer's format)."""
        for c in _COLUMNS:
            value = row[c]
            if self.fmt == "conversational" and c in _COLUMNS[:3]:
                value = [{"role": "user" if c == "prompt" else "assistant", "content": value}]
            self._batch[c].append(value)
        self.rows += 1
        if len(self._batch["prompt"]) == BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._batch["prompt"]:
            self._writer.write_batch(pa.RecordBatch.from_pydict(self._batch, schema=self.schema))
            self._batch = {c: [] for c in _COLUMNS}

    def close(self) -> int:
        self._flush()
        self._writer.close()
        self._sink.close()
        digest = hashlib.sha256()
        with open(self.directory / ARROW_FILE, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        state = {
            "_data_files": [{"filename": ARROW_FILE}],
            "_fingerprint": digest.hexdigest()[:16],
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        (self.directory / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        info = {"citation": "", "description": "", "features": feature_dict(self.fmt), "homepage": "", "license": ""}
        (self.directory / "dataset_info.json").write_text(json.dumps(info, indent=2))
        return self.rows


def write_dataset_dict(directory: Path, splits: tuple[str, ...]) -> None:
    """The ``dataset_dict.json`` of a stage directory."""
    (Path(directory) / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
