"""Damaged and hostile checkpoints, as a user meets them through each verb: exit code 2, one
line naming the file, no traceback, nothing new written, and no code from the checkpoint run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint.integrity import MANIFEST_NAME, write_manifest
from scaletrain.checkpoint.safe_dcp import read_metadata
from scaletrain.cli import main
from tests.helpers.finetune import qa_records, write_jsonl
from tests.helpers.trainer import tiny_argv, tiny_config

SHARD = "__0_0.distcp"


class Payload:
    """A pickle that runs a shell command when loaded (what a hostile checkpoint would hold)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A tiny training run with one checkpoint (step 2), tokenizer included."""
    from scaletrain.train.trainer import Trainer

    out = tmp_path_factory.mktemp("good") / "run"
    Trainer(tiny_config(out, cache, "--training.steps", "2")).train()
    return out


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / "step-0000002"


def _rehash(ck: Path) -> None:
    """A consistent manifest, as someone who edits (or forges) a checkpoint would leave it."""
    (ck / MANIFEST_NAME).unlink()
    write_manifest(ck)


def _span(ck: Path, fqn: str) -> tuple[int, int]:
    """(offset, length) of `fqn`'s bytes in the shard file."""
    md = read_metadata(ck)
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    return info.offset, info.length


def flipped(ck: Path, marker: Path) -> str:
    shard = ck / SHARD
    data = bytearray(shard.read_bytes())
    data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])
    shard.write_bytes(bytes(data))
    return SHARD


def truncated(ck: Path, marker: Path) -> str:
    shard = ck / SHARD
    shard.write_bytes(shard.read_bytes()[:1000])
    return SHARD


def missing(ck: Path, marker: Path) -> str:
    (ck / SHARD).unlink()
    return SHARD


def bad_manifest(ck: Path, marker: Path) -> str:
    (ck / MANIFEST_NAME).write_text('{"format": "scaletrain-manifest", "files": ')
    return MANIFEST_NAME


def bad_meta(ck: Path, marker: Path) -> str:
    meta = ck / "meta.json"
    meta.write_text(meta.read_text()[:40])
    _rehash(ck)
    return "meta.json"


def bad_metadata(ck: Path, marker: Path) -> str:
    md = ck / ".metadata"
    md.write_bytes(md.read_bytes()[:300])
    _rehash(ck)
    return ".metadata"


def pickle_payload(ck: Path, marker: Path) -> str:
    (ck / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rehash(ck)
    return ".metadata"


def wrong_shape(ck: Path, marker: Path) -> str:
    meta = json.loads((ck / "meta.json").read_text())
    meta["model_args"]["ffn_dim"] = 256
    (ck / "meta.json").write_text(json.dumps(meta))
    _rehash(ck)
    return "meta.json"


def nan_weights(ck: Path, marker: Path) -> str:
    offset, length = _span(ck, "model.tok_embeddings.weight")
    shard = ck / SHARD
    data = bytearray(shard.read_bytes())
    mid = offset + length // 2
    data[mid:mid + 4096] = b"\xff" * 4096  # 1,024 float32 NaNs
    shard.write_bytes(bytes(data))
    _rehash(ck)
    return "tok_embeddings.weight"


CASES: list[Callable[[Path, Path], str]] = [flipped, truncated, missing, bad_manifest, bad_meta,
                                            bad_metadata, pickle_payload, wrong_shape,
                                            nan_weights]


def _argv(verb: str, run: Path, tmp: Path, cache: Path) -> list[str]:
    if verb == "train":  # resume
        return ["train", *tiny_argv(run, cache, "--training.steps", "4",
                                    "--checkpoint.resume", "true")]
    if verb == "generate":
        return ["generate", "--checkpoint", str(run), "--prompt-ids", "1,2",
                "--max-new-tokens", "1"]
    if verb == "serve":
        return ["serve", "--checkpoint", str(run), "--port", "0"]
    if verb == "convert":
        return ["convert", str(run), str(tmp / "converted"), "--to", "hf"]
    if verb == "finetune":
        data = write_jsonl(tmp / "sft.jsonl", qa_records(40))
        return ["finetune", "--base", str(run), "--data", str(data), "--output",
                str(tmp / "ft"), "--training.steps", "1", "--metrics.tensorboard", "false",
                "--metrics.progress_bar", "false"]
    assert verb == "synth"
    return ["data", "synth", "--checkpoint", str(run), "--topics", "rain", "--out",
            str(tmp / "synth"), "--num-prompts", "1", "--judge", "none"]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("verb", ["train", "generate", "serve", "convert", "finetune", "synth"])
@pytest.mark.parametrize("damage", CASES, ids=lambda f: f.__name__)
def test_damaged_checkpoint_exit_2_one_line(verb: str, damage: Callable[[Path, Path], str],
                                            good_run: Path, cache: Path, tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str],
                                            caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    marker = tmp_path / "payload-ran"
    named = damage(_ckpt(run), marker)
    before = _files(run)
    capfd.readouterr()

    rc = main(_argv(verb, run, tmp_path, cache))

    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert named in lines[0], lines[0]
    assert "Traceback" not in err and "Traceback" not in caplog.text
    assert not marker.exists(), "the pickle payload ran"
    assert _files(run) == before  # no new checkpoint (nor anything else) in the run
    assert not (tmp_path / "converted").exists()
    assert not list((tmp_path / "ft").glob("checkpoints/step-*"))
    assert not list(tmp_path.glob(".converted.tmp-*"))


def test_verification_off_skips_hashes_but_not_safety(good_run: Path, tmp_path: Path,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    ck = _ckpt(run)
    (ck / MANIFEST_NAME).unlink()  # e.g. a checkpoint of an older scaletrain
    gen = ["generate", "--checkpoint", str(run), "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    assert main(gen) == 2
    assert "manifest.json not found" in capfd.readouterr().err
    assert main([*gen, "--no-verify"]) == 0
    marker = tmp_path / "payload-ran"
    (ck / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    assert main([*gen, "--no-verify"]) == 2
    assert "refused" in capfd.readouterr().err and not marker.exists()


def test_pickled_object_in_training_state_is_refused(good_run: Path, cache: Path,
                                                     tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """Non-tensor entries (schedule, loader state) are read weights-only too (RNG states are
    tensors, one entry per rank)."""
    from scaletrain.train.trainer import Trainer

    out = tmp_path / "run"
    trainer = Trainer(tiny_config(out, cache, "--training.steps", "2"))
    marker = tmp_path / "payload-ran"
    extra = trainer._extra_state()
    extra["lr_schedule"]["step"] = Payload(marker)
    trainer.checkpointer.save(2, trainer.model, trainer.optimizer, extra)  # valid manifest
    before = _files(out)
    rc = main(["train", *tiny_argv(out, cache, "--training.steps", "4",
                                   "--checkpoint.resume", "true")])
    err = capfd.readouterr().err
    assert rc == 2 and "extra.lr_schedule.step" in err and "refused" in err, err
    assert not marker.exists() and _files(out) == before


def test_non_finite_state_is_never_saved(cache: Path, tmp_path: Path) -> None:
    from scaletrain.train.checkpoint import NonFiniteStateError
    from scaletrain.train.trainer import Trainer

    out = tmp_path / "run"
    trainer = Trainer(tiny_config(out, cache, "--training.steps", "1"))
    trainer.train()
    before = _files(out / "checkpoints")
    with torch.no_grad():
        trainer.model.tok_embeddings.weight[0, :5] = float("nan")
    trainer.step = 5
    with pytest.raises(NonFiniteStateError, match=r"tok_embeddings.weight \(5 of"):
        trainer.save_checkpoint()
    assert _files(out / "checkpoints") == before


def test_finetune_pins_the_exact_base_checkpoint(good_run: Path, cache: Path, tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """The adapter stays on the checkpoint it was trained on when the base run gains a newer
    one; a changed base checkpoint is refused unless --allow-base-mismatch."""
    from scaletrain.train.trainer import Trainer

    base = tmp_path / "base"
    shutil.copytree(good_run, base)
    data = write_jsonl(tmp_path / "sft.jsonl", qa_records(40))
    ft = tmp_path / "ft"
    assert main(["finetune", "--base", str(base), "--data", str(data), "--output", str(ft),
                 "--method", "lora", "--training.steps", "2", "--training.micro_batch_size",
                 "2", "--data.seq_len", "64", "--metrics.tensorboard", "false",
                 "--metrics.progress_bar", "false"]) == 0
    meta = json.loads((ft / "finetune.json").read_text())
    assert meta["base_checkpoint"] == str(_ckpt(base).resolve())
    assert meta["base_fingerprint"].startswith("xxh3_128:")
    gen = ["generate", "--checkpoint", str(ft), "--prompt-ids", "1,2", "--max-new-tokens", "3",
           "--temperature", "0", "--json"]
    assert main(gen) == 0
    first = json.loads(capfd.readouterr().out)["ids"]

    # The base run continues and saves step 4: the fine-tune still uses step 2.
    Trainer(tiny_config(base, cache, "--training.steps", "4", "--checkpoint.resume", "true",
                        "--checkpoint.keep_last", "5")).train()
    assert main(gen) == 0
    assert json.loads(capfd.readouterr().out)["ids"] == first

    # Step 2 itself is replaced by other weights (with a valid manifest): refused.
    shutil.rmtree(_ckpt(base))
    shutil.copytree(base / "checkpoints" / "step-0000004", _ckpt(base))
    assert main(gen) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allow-base-mismatch" in err[0] and "finetune.json" in err[0]
    assert main([*gen, "--allow-base-mismatch"]) == 0
    # Resuming the LoRA run on the changed base is refused too.
    assert main(["finetune", "--base", str(base), "--data", str(data), "--output", str(ft),
                 "--method", "lora", "--training.steps", "3", "--data.seq_len", "64",
                 "--training.micro_batch_size", "2", "--checkpoint.allow_schedule_change",
                 "true", "--checkpoint.resume", "true", "--metrics.tensorboard", "false",
                 "--metrics.progress_bar", "false"]) == 2
    assert "allow_base_mismatch" in capfd.readouterr().err


def test_hf_base_fingerprint_follows_its_files(good_run: Path, tmp_path: Path) -> None:
    from scaletrain.checkpoint.integrity import checkpoint_fingerprint

    hf = tmp_path / "hf"
    assert main(["convert", str(good_run), str(hf), "--to", "hf"]) == 0
    first = checkpoint_fingerprint(hf)
    assert first == checkpoint_fingerprint(hf) and first.startswith("xxh3_128-files:")
    weights = hf / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)
    weights.write_bytes(bytes(data))
    assert checkpoint_fingerprint(hf) != first


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_convert_output_honours_umask(good_run: Path, tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        for to in ("hf", "native"):
            dst = tmp_path / f"out-{to}"
            assert main(["convert", str(good_run), str(dst), "--to", to]) == 0
            assert dst.stat().st_mode & 0o777 == 0o777 & ~mask
            for f in dst.iterdir():
                assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f
    finally:
        os.umask(old)


def test_hash_benchmark_reports_its_rows(tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "checkpoint_hash_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_checkpoint_hash_cpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    result = bench.main(["--mb", "20", "--dim", "256", "--repeats", "1", "--dir",
                         str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["hash_mb_per_s"] > 0 and result["load_verify_on_s"] > 0
    assert not list(tmp_path.glob("ckpt-hash-*"))  # cleaned up


def test_trust_flags_reach_worker_threads_and_are_restored() -> None:
    import argparse
    import threading

    from scaletrain.checkpoint.integrity import verification_enabled
    from scaletrain.commands._checkpoint_flags import trust_settings

    seen: list[bool] = []
    with trust_settings(argparse.Namespace(no_verify=True, allow_base_mismatch=False)):
        worker = threading.Thread(target=lambda: seen.append(verification_enabled()))
        worker.start()
        worker.join()
        assert not verification_enabled()
    assert seen == [False]
    assert verification_enabled()
