"""Read back what the experiment trackers stored, without their servers: the records of a
W&B offline run file, an MLflow store and TensorBoard event files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # checksum (4), length (2), type (1): LevelDB's log format, which W&B uses
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_chunks(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path}: not a W&B run file")
    records, pending, pos = [], b"", 7  # ":W&B", magic (2), version (1)
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        body = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind == _FULL:
            records.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            records.append(pending + body)
            pending = b""
    return records


def wandb_run(folder: Path) -> dict[str, Any]:
    """{'history': [rows], 'summary': {...}, 'config': {...}} of the one offline run under
    `folder` (a `wandb/` directory's parent)."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb"))
    if len(files) != 1:
        raise AssertionError(f"expected one W&B offline run under {folder}, found {files}")
    out: dict[str, Any] = {"history": [], "summary": {}, "config": {}}
    for chunk in _wandb_chunks(files[0]):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(chunk)
        kind = rec.WhichOneof("record_type")

        def key(item: Any) -> str:
            return item.key or "/".join(item.nested_key)

        if kind == "history":
            out["history"].append({key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "config":
            out["config"].update({key(i): json.loads(i.value_json) for i in rec.config.update})
    return out


def mlflow_runs(uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return [r for e in client.search_experiments() for r in
            client.search_runs([e.experiment_id])]


def mlflow_history(uri: str, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id,
                                                                                      key)}


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_texts(logdir: Path) -> dict[str, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        if tag.endswith("/text_summary"):
            ev = acc.Tensors(tag)[-1]
            out[tag.removesuffix("/text_summary")] = ev.tensor_proto.string_val[0].decode()
    return out
