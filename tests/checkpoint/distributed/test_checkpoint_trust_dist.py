"""Damaged checkpoints under several processes: when only one rank sees the damage (its share
of the hash check, or NaNs in its own shard), every rank stops with the same one-line error
instead of leaving the others waiting in a collective."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.dist_worker import BASE, MODEL, spawn
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

LAYOUT = ["--parallel.data_parallel", "zero3", "--training.steps", "4"]


def _resume(rank: int, world: int, runs: list[str], cache: str, out: str) -> None:
    from scaletrain.train.checkpoint import CheckpointError
    from scaletrain.train.trainer import Trainer

    errors = []
    for run in runs:
        try:
            Trainer(tiny_config(Path(run), Path(cache), *MODEL, *BASE, *LAYOUT,
                                "--checkpoint.resume", "true"))
            errors.append(None)
        except CheckpointError as e:
            errors.append(str(e))
    Path(out, f"rank{rank}.json").write_text(json.dumps(errors))


@pytest.mark.distributed
def test_damage_seen_by_one_rank_stops_all(tmp_path: Path) -> None:
    from scaletrain.checkpoint.integrity import MANIFEST_NAME, verify_manifest, write_manifest
    from scaletrain.checkpoint.safe_dcp import read_metadata

    cache, saved = tmp_path / "cache", tmp_path / "saved"
    spawn(2, [("save", [str(saved), str(cache), *LAYOUT], {"save": True})], 2, tmp_path)
    ck = saved / "checkpoints" / "step-0000002"
    verify_manifest(ck, "")  # the ranks' shares make one complete manifest
    listed = set(json.loads((ck / MANIFEST_NAME).read_text())["files"])
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json"} <= listed

    flipped, nans = tmp_path / "flipped", tmp_path / "nans"
    for run in (flipped, nans):
        shutil.copytree(saved, run)
    # Rank 1 hashes the second file of the sorted list (__0_0.distcp); rank 0 must stop too.
    shard = flipped / "checkpoints" / "step-0000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[2048:4096] = bytes(b ^ 0xFF for b in data[2048:4096])
    shard.write_bytes(bytes(data))
    # NaNs in rank 1's half of the embedding (a consistent manifest: only the values are bad).
    ck = nans / "checkpoints" / "step-0000002"
    info = next(v for k, v in read_metadata(ck).storage_data.items()
                if k.fqn == "model.tok_embeddings.weight" and v.relative_path == "__1_0.distcp")
    shard = ck / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    mid = info.offset + info.length // 2
    data[mid:mid + 1024] = b"\xff" * 1024
    shard.write_bytes(bytes(data))
    (ck / MANIFEST_NAME).unlink()
    write_manifest(ck)

    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_resume, 2, [str(flipped), str(nans)], str(cache), str(out))
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert per_rank[0] == per_rank[1]
    hash_err, nan_err = per_rank[0]
    assert "__0_0.distcp does not match its xxh3_128 hash" in hash_err
    assert "NaN/inf values in model.tok_embeddings.weight" in nan_err
    assert all("\n" not in e for e in per_rank[0])
