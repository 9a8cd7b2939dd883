"""Read the history of an offline wandb run (``WANDB_MODE=offline``) from its ``run-*.wandb`` file.

The file is wandb's transaction log: a 7-byte header (``:W&B``, magic ``0xBEE1``, version 0), then LevelDB-log
records (4-byte CRC, 2-byte length, 1-byte type: full, first, middle, last) in 32 KiB blocks, each record a
serialized ``wandb_internal_pb2.Record``. The wandb package itself no longer ships a Python reader.
"""

from __future__ import annotations

import struct
from pathlib import Path

HEADER_LEN = 7
BLOCK_LEN = 32 * 1024
RECORD_HEADER_LEN = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str | Path) -> list[bytes]:
    """The raw protobuf records of a ``.wandb`` transaction log, in order."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb transaction log")
    records: list[bytes] = []
    pending = b""
    pos = HEADER_LEN
    while pos + RECORD_HEADER_LEN <= len(data):
        left_in_block = BLOCK_LEN - pos % BLOCK_LEN
        if left_in_block < RECORD_HEADER_LEN:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER_LEN])
        payload = data[pos + RECORD_HEADER_LEN : pos + RECORD_HEADER_LEN + length]
        pos += RECORD_HEADER_LEN + length
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        if kind == FULL:
            records.append(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            records.append(pending + payload)
            pending = b""
    return records


def wandb_history(run_dir: str | Path) -> list[dict[str, str]]:
    """Every ``wandb.log`` row of the offline run in ``run_dir`` (``offline-run-*``): ``{key: JSON value}``."""
    from wandb.proto import wandb_internal_pb2

    (log_file,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for raw in wandb_records(log_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows
