"""Read back the history of an offline W&B run from its ``run-*.wandb`` file (no network, no wandb service).

The file is wandb's datastore: a 7-byte header (``:W&B``, magic 0xBEE1, version 0)
followed by LevelDB log records (32 KiB blocks; each record: crc32c (4), length
(2, little-endian), type (1: full, 2: first, 3: middle, 4: last), data), each
record's data a ``wandb_internal_pb2.Record`` protobuf. wandb 0.31 no longer
ships a Python reader, so this is ours.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def _records(data: bytes):
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer: zero padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_history(run_dir: str | Path) -> list[dict]:
    """The logged rows ``[{key: value, '_step': k}]`` of the offline run in ``run_dir``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for raw in _records(path.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows
