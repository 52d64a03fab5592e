"""Reading back what the trainer's W&B and TensorBoard sinks wrote, with the packages' own protobuf
messages: TensorBoard event files (TFRecord framing) and a W&B offline run's ``.wandb`` file."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def event_files(logdir: Path) -> list[list[object]]:
    """Every event file under ``logdir``, each as its events (TFRecord framing: u64 length, u32 CRC,
    data, u32 CRC)."""
    from tensorboardX.proto import event_pb2

    files = []
    for path in logdir.glob("events.out.tfevents.*"):
        data, i, events = path.read_bytes(), 0, []
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + n])
            events.append(event)
            i += 12 + n + 4
        files.append(events)
    return files


def scalars(events: list[object]) -> dict[tuple[str, int], float]:
    return {(v.tag, e.step): v.simple_value for e in events for v in e.summary.value}  # type: ignore[attr-defined]


def wandb_records(path: Path) -> Iterator[object]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic 0xBEE1, version), then LevelDB
    log framing (32 KiB blocks; per chunk u32 CRC, u16 length, u8 type full/first/middle/last), each
    record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1)
    i, pending = 7, b""
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a header is padding
            i += 32768 - i % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[i:i + 7])
        pending += data[i + 7:i + 7 + n]
        i += 7 + n
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclass
class WandbRun:
    """What one trainer process left in ``RUN_DIR/wandb``."""

    directory: Path
    run_id: str
    config: dict[str, object]
    history: list[dict[str, object]]


def read_wandb_run(directory: Path) -> WandbRun:
    (path,) = directory.glob("run-*.wandb")
    run_id, config, history = "", {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")  # type: ignore[attr-defined]
        if kind == "run":
            run_id = record.run.run_id  # type: ignore[attr-defined]
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}  # type: ignore[attr-defined]
        elif kind == "history":
            items = record.history.item  # type: ignore[attr-defined]
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items})
    return WandbRun(directory, run_id, config, history)
