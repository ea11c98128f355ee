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


def read_history(run_dir: str | Path, *, timeout: float = 60.0) -> list[dict]:
    """The logged rows ``[{key: value, '_step': k}]`` of the offline run in ``run_dir``.

    wandb's service process writes the file; ``run.finish()`` returns once the run is closed, but on a loaded
    machine the last records can land a moment later, so this reads until the run's ``exit`` record is there.
    """
    import time

    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        (path,) = Path(run_dir).glob("run-*.wandb")
        rows, done = [], False
        for raw in _records(path.read_bytes()):
            rec = pb.Record()
            try:
                rec.ParseFromString(raw)
            except DecodeError:  # a record the service process is still writing: read the file again
                if time.monotonic() > deadline:
                    raise
                done = False
                break
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                             for item in rec.history.item})
            done = done or kind == "exit"
        if done or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)
