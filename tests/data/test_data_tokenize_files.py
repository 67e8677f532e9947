"""`data tokenize` at any file count: many small files are packed into a few parts (the
tokenizer loaded once per worker), the dataset equals the one from a single file holding
the same lines, and an interrupted run's parts are reused (or cleared when stale)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import scaletrain.data.tokenize as tokenize_mod
import scaletrain.data.tokenize_parts as parts_mod
from scaletrain.commands import data as data_cmd
from scaletrain.data.tokenize import tokenize_to_indexed
from tests.helpers.curate import fixture_dir, write_jsonl

LINES = [{"text": f"line {i}: the quick brown fox jumps over the lazy dog {i * 13}."}
         for i in range(300)]


def _many(tmp_path: Path, n: int = 300) -> tuple[Path, Path]:
    """The same lines as `n` one-line files (in a tree) and as one file."""
    many = tmp_path / "many"
    for i, rec in enumerate(LINES[:n]):
        write_jsonl(many / f"d{i // 100:02d}" / f"f{i:05d}.jsonl", [rec])
    one = write_jsonl(tmp_path / "one" / "all.jsonl", LINES[:n])
    return many, one


def _bytes(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def test_many_small_files_make_one_part_and_the_same_dataset(tmp_path: Path, capsys,
                                                             monkeypatch) -> None:
    many, one = _many(tmp_path)
    loads = []
    real_load = tokenize_mod.TextTokenizer.load
    monkeypatch.setattr(tokenize_mod.TextTokenizer, "load",
                        staticmethod(lambda *a, **k: loads.append(a) or real_load(*a, **k)))
    tok = str(fixture_dir() / "gpt-neox-tokenizer.json")
    argv = ["tokenize", "--tokenizer", tok, "--workers", "2", "--json"]
    assert data_cmd.main([*argv, "--input", str(many), "--output", str(tmp_path / "m")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["files"] == 300 and out["parts"] == 1 and out["documents"] == 300
    assert out["records"] == out["documents"] + out["empty"] + out["malformed"]
    assert len(loads) <= 2  # the check up front and one per worker, not one per file
    assert data_cmd.main([*argv, "--input", str(one), "--output", str(tmp_path / "o")]) == 0
    assert _bytes(tmp_path / "m") == _bytes(tmp_path / "o")
    assert not list(tmp_path.glob("*.parts-tmp"))


def test_groups_follow_bytes_and_keep_file_order(tmp_path: Path, monkeypatch) -> None:
    many, one = _many(tmp_path, 60)
    files = sorted(str(f) for f in many.rglob("*.jsonl"))
    stats = parts_mod.file_stats(files)
    assert len(parts_mod.group_files(stats, workers=4)) == 1  # tiny: one part
    monkeypatch.setattr(parts_mod, "GROUP_MIN_BYTES", 1000)
    groups = parts_mod.group_files(stats, workers=2)
    assert len(groups) > 3 and [f.path for g in groups for f in g] == files
    monkeypatch.setattr(parts_mod, "GROUP_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(parts_mod, "GROUP_MIN_FILES", 10)  # many tiny files: split by count
    groups = parts_mod.group_files(stats, workers=2)
    assert [len(g) for g in groups] == [10] * 6
    tok = fixture_dir() / "gpt-neox-tokenizer.json"
    tokenize_to_indexed([one], tmp_path / "o", tok, workers=1)
    for encoded_here in (False, True):  # workers forked; spawned once this process encoded
        monkeypatch.setattr(tokenize_mod, "_ENCODED_HERE", encoded_here)
        assert tokenize_mod._start_method() == ("spawn" if encoded_here else "fork")
        out = tmp_path / f"g-{encoded_here}"
        tokenize_to_indexed(files, out, tok, workers=2)  # several parts, 2 processes
        assert _bytes(out) == _bytes(tmp_path / "o")


def test_an_interrupted_run_is_resumed_from_its_finished_parts(tmp_path: Path,
                                                               monkeypatch) -> None:
    many, one = _many(tmp_path, 60)
    files = sorted(many.rglob("*.jsonl"))
    tok = fixture_dir() / "gpt-neox-tokenizer.json"
    monkeypatch.setattr(parts_mod, "GROUP_MIN_BYTES", 1000)
    n_parts = len(parts_mod.group_files(parts_mod.file_stats([str(f) for f in files]), 1))
    real = tokenize_mod.write_texts
    calls = []

    def interrupted_at_the_third_part(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tokenize_mod, "write_texts", interrupted_at_the_third_part)
    with pytest.raises(KeyboardInterrupt):
        tokenize_to_indexed(files, tmp_path / "r", tok, workers=1)
    left = tmp_path / "r.parts-tmp"
    assert sorted(p.name for p in left.glob("part-*.json")) == ["part-00000-0000.json",
                                                                "part-00001-0000.json"]
    assert not Path(f"{tmp_path}/r.bin").exists()  # no dataset that looks whole
    calls.clear()
    monkeypatch.setattr(tokenize_mod, "write_texts", lambda *a, **k: calls.append(1) or
                        real(*a, **k))
    stats = tokenize_to_indexed(files, tmp_path / "r", tok, workers=1)
    assert len(calls) == n_parts - 2  # only the unfinished parts are tokenized again
    assert stats.documents == 60 and not left.exists()
    tokenize_to_indexed([one], tmp_path / "o", tok, workers=1)
    assert _bytes(tmp_path / "r") == _bytes(tmp_path / "o")


def test_stale_leftovers_of_another_run_are_cleared(tmp_path: Path) -> None:
    many, one = _many(tmp_path, 20)
    left = tmp_path / "s.parts-tmp"
    left.mkdir()
    (left / "plan.json").write_text(json.dumps({"fingerprint": "another run"}))
    (left / "part-00000.json").write_text(json.dumps({"documents": 999}))
    (left / "part-00000.bin").write_bytes(b"stale")
    stats = tokenize_to_indexed(sorted(many.rglob("*.jsonl")), tmp_path / "s",
                                fixture_dir() / "gpt-neox-tokenizer.json")
    assert stats.documents == 20 and not left.exists()


def test_a_resume_redoes_the_parts_whose_files_changed(tmp_path: Path, monkeypatch) -> None:
    many, _ = _many(tmp_path, 60)
    files = sorted(many.rglob("*.jsonl"))
    tok = fixture_dir() / "gpt-neox-tokenizer.json"
    monkeypatch.setattr(parts_mod, "GROUP_MIN_BYTES", 1000)
    groups = parts_mod.group_files(parts_mod.file_stats([str(f) for f in files]), 1)
    real = tokenize_mod.write_texts
    calls = []

    def interrupted_at_the_third_part(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tokenize_mod, "write_texts", interrupted_at_the_third_part)
    with pytest.raises(KeyboardInterrupt):
        tokenize_to_indexed(files, tmp_path / "r", tok, workers=1)
    # a file of the finished first part changes (same size, new content and time)
    changed = Path(groups[0][1].path)
    changed.write_text(changed.read_text().replace("quick", "QUICK"))
    calls.clear()
    monkeypatch.setattr(tokenize_mod, "write_texts", lambda *a, **k: calls.append(1) or
                        real(*a, **k))
    tokenize_to_indexed(files, tmp_path / "r", tok, workers=1)
    assert len(calls) == len(groups) - 1  # part 0 again, part 1 reused, the rest
    monkeypatch.setattr(tokenize_mod, "write_texts", real)
    tokenize_to_indexed(files, tmp_path / "fresh", tok, workers=1)
    assert _bytes(tmp_path / "r") == _bytes(tmp_path / "fresh")
    texts = [json.loads(f.read_text())["text"] for f in files]
    tokenize_to_indexed(files, tmp_path / "fresh2", tok, workers=2)  # parts in 2 processes
    assert _bytes(tmp_path / "fresh2") == _bytes(tmp_path / "fresh")
    assert any("QUICK" in t for t in texts)


def test_groups_are_given_as_they_fill_and_grow_round_by_round(monkeypatch) -> None:
    monkeypatch.setattr(parts_mod, "GROUP_MIN_BYTES", 1000)
    monkeypatch.setattr(parts_mod, "GROUP_MAX_BYTES", 4000)
    stats = [parts_mod.FileStat(f"f{i:04d}", 100, 0) for i in range(1000)]
    groups = parts_mod.group_files(stats, workers=1)  # a round: 4 groups
    assert [len(g) for g in groups[:16]] == [10] * 4 + [20] * 4 + [40] * 8
    assert [f for g in groups for f in g] == stats
    seen = []
    stream = parts_mod.stream_groups((seen.append(f) or f for f in stats), len(stats), 1)
    assert len(next(stream)) == 10 and len(seen) == 11  # no need to look at every file first


def test_many_files_are_split_by_count_and_cut_into_parts_as_they_are_read(
        tmp_path: Path, monkeypatch) -> None:
    """Above STAT_FILES_MAX files the driver stats nothing: groups by count, each cut by
    the workers into parts of about GROUP_MAX_BYTES; interrupted, changed and resumed, the
    dataset is still the one of a single file holding the same lines."""
    many, one = _many(tmp_path, 60)
    files = sorted(many.rglob("*.jsonl"))
    tok = fixture_dir() / "gpt-neox-tokenizer.json"
    tokenize_to_indexed([one], tmp_path / "o", tok, workers=1)
    monkeypatch.setattr(parts_mod, "STAT_FILES_MAX", 10)
    monkeypatch.setattr(parts_mod, "GROUP_MAX_BYTES", 300)  # about 4 files a part
    real_stat = parts_mod.stat_files
    stat_calls = []
    monkeypatch.setattr(parts_mod, "stat_files",
                        lambda paths: stat_calls.append(1) or real_stat(paths))
    stats = tokenize_to_indexed(files, tmp_path / "c", tok, workers=1)
    assert not stat_calls  # sizes and times came with the open files
    assert stats.parts > 8 and stats.documents == 60  # 4 groups (1 worker), each cut
    assert _bytes(tmp_path / "c") == _bytes(tmp_path / "o")
    tokenize_to_indexed(files, tmp_path / "c2", tok, workers=2)  # 8 groups, 2 processes
    assert _bytes(tmp_path / "c2") == _bytes(tmp_path / "o")

    real = tokenize_mod.write_texts
    calls = []

    def interrupted_at_the_sixth_part(*a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tokenize_mod, "write_texts", interrupted_at_the_sixth_part)
    with pytest.raises(KeyboardInterrupt):
        tokenize_to_indexed(files, tmp_path / "r", tok, workers=1)
    left = tmp_path / "r.parts-tmp"
    finished = sorted(left.glob("part-*.json"))
    first_group = sorted(left.glob("part-00000-*.json"))
    assert len(finished) == 5 and 1 < len(first_group) < 5
    second = json.loads(first_group[1].read_text())  # the 2nd part of group 0 changes
    changed = Path(str(files[second["start"]]))
    changed.write_text(changed.read_text().replace("quick", "QUICK"))
    calls.clear()
    monkeypatch.setattr(tokenize_mod, "write_texts", lambda *a, **k: calls.append(1) or
                        real(*a, **k))
    stats = tokenize_to_indexed(files, tmp_path / "r", tok, workers=1)
    reused = 1 + (len(finished) - len(first_group))  # part 0 of group 0, the later groups'
    assert len(calls) == stats.parts - reused and not left.exists()
    monkeypatch.setattr(tokenize_mod, "write_texts", real)
    tokenize_to_indexed(files, tmp_path / "fresh", tok, workers=1)
    assert _bytes(tmp_path / "r") == _bytes(tmp_path / "fresh") != _bytes(tmp_path / "o")
