"""Prose is prose: a plain-text file's kind comes from its content (a `.txt` of prose gets
the web text rules, code stays under the code rules), the report gives drops per kind and a
hint when one rule drops most of a folder; and files over a document's character limit are
dropped from their size, or read only up to the limit, never whole."""

from __future__ import annotations

import random
import shutil
import sysconfig
import tracemalloc
from pathlib import Path

import pytest

from scaletrain.curate.documents import Document
from scaletrain.curate.executors import LocalExecutor
from scaletrain.curate.filters import CountsFilter
from scaletrain.curate.io import readers
from scaletrain.curate.io.readers import ReadReport, Shard, TooLong, read_shard, sniff_format
from scaletrain.curate.io.sniff import looks_like_prose
from scaletrain.curate.pipeline import Pipeline
from scaletrain.curate.registry import DEFAULT_MIXED_PIPELINE, build_step
from scaletrain.curate.runner import run_pipeline
from tests.helpers.curate import fixture_dir, read_output

_STDLIB = Path(sysconfig.get_paths()["stdlib"])
_VOCABULARY = ("the a of to and in that is was for on with as by at from this it be are we they "
          "river garden morning letter village winter market station kitchen window journey "
          "friend teacher library mountain harbour evening story music paper walked wrote "
          "opened found quiet early bright long")
_WORDS = _VOCABULARY.split()


def _note(rng: random.Random, lo: int, hi: int) -> str:
    """One paragraph on one line, `lo`-`hi` characters, of sentences."""
    n, out = rng.randint(lo, hi), []
    while len(" ".join(out)) < n:
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))).capitalize()
                   + ".")
    return " ".join(out)


def _per_kind_rules() -> list:
    """The default pipeline's per-kind rules (its first stage: no dedup, no PII)."""
    return [build_step(s) for s in DEFAULT_MIXED_PIPELINE if "only" in s]


def _kept_by(rules: list, texts: dict[str, str]) -> set[str]:
    """What the rules keep of the texts applied directly, every rule on every text."""
    for r in rules:
        r.only = None
    docs = [Document(name, text) for name, text in texts.items()]
    pipe = Pipeline(rules)
    return {d.id for d in pipe.run(docs, pipe.new_stats())}


def test_prose_is_told_from_code_by_content() -> None:
    rng = random.Random(1)
    assert all(looks_like_prose(_note(rng, 150, 400)) for _ in range(50))
    import gzip
    import json

    for f in sorted(fixture_dir().glob("ccnet_*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            assert all(looks_like_prose(json.loads(line)["text"]) for line in fh)
    code = [p for pkg in ("email", "json", "asyncio") for p in sorted((_STDLIB / pkg).glob("*.py"))]
    assert sum(looks_like_prose(p.read_text(encoding="utf-8")) for p in code) <= len(code) // 20
    assert not looks_like_prose((_STDLIB / "lib2to3" / "Grammar.txt").read_text()) \
        if (_STDLIB / "lib2to3" / "Grammar.txt").exists() else True


def test_a_prose_folder_keeps_what_the_text_rules_keep(tmp_path: Path) -> None:
    rng = random.Random(7)
    src = tmp_path / "repo"
    (src / "notes").mkdir(parents=True)
    notes = {f"notes/n{i:03d}.txt": _note(rng, 150, 400) for i in range(30)}
    notes |= {f"notes/long{i:03d}.md": "\n\n".join(_note(rng, 300, 500) for _ in range(4))
              for i in range(10)}
    for name, text in notes.items():
        (src / name).write_text(text, encoding="utf-8")
    code = {f"src/{p.name}": p.read_text(encoding="utf-8")
            for p in sorted((_STDLIB / "json").glob("*.py"))}
    code["src/decoder_copy.txt"] = code["src/decoder.py"] + "\n# copy\n"  # code named .txt
    for name, text in code.items():
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_text(text, encoding="utf-8")
    assert sniff_format(str(src / "notes/n000.txt")) == "prose"
    assert sniff_format(str(src / "src/decoder_copy.txt")) == "text"

    summary = run_pipeline(_per_kind_rules(), str(src), str(tmp_path / "out"),
                           LocalExecutor(workers=1))
    kept = {d["id"] for d in read_output(tmp_path / "out")}
    web_rules = [build_step(s) for s in DEFAULT_MIXED_PIPELINE if s.get("only") == "web"]
    code_rules = [build_step(s) for s in DEFAULT_MIXED_PIPELINE if s.get("only") == "code"]
    assert kept & set(notes) == _kept_by(web_rules, notes)
    assert kept & set(code) == _kept_by(code_rules, code)
    assert len(kept & set(notes)) >= 10  # the long notes pass the text rules
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["code"]["seen"] == len(code) and steps["gopher_quality"]["seen"] == len(notes)
    assert steps["code"]["dropped"].get("avg_line_too_long", 0) == 0
    kinds = summary["by_kind"]
    assert kinds["prose"]["documents"] == len(notes) and kinds["code"]["documents"] == len(code)
    assert kinds["prose"]["top_reasons"][0][0].startswith("gopher_quality: ")


def test_a_hint_names_the_rule_that_drops_most_of_a_folder(tmp_path: Path) -> None:
    rng = random.Random(3)
    (tmp_path / "in" / "short").mkdir(parents=True)
    for i in range(12):  # one-paragraph notes of about 25 words: under Gopher's 50
        (tmp_path / "in" / "short" / f"{i}.txt").write_text(_note(rng, 150, 180))
    summary = run_pipeline(_per_kind_rules(), str(tmp_path / "in"), str(tmp_path / "out"),
                           LocalExecutor(workers=1))
    assert summary["kept"] == 0
    (hint,) = summary["hints"]
    assert hint.startswith("gopher_quality: too_few_words dropped 12 of the 12 documents")
    assert "short/" in hint and "12 prose" in hint


def test_a_file_over_the_limit_is_dropped_from_its_size(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in").mkdir()
    big = tmp_path / "in" / "huge.log"
    with open(big, "wb") as f:  # 200 MB, sparse: zeros, which a read would call binary
        f.truncate(200 << 20)
    shutil.copy(_STDLIB / "json" / "decoder.py", tmp_path / "in" / "decoder.py")
    real = readers._decoded

    def no_big_reads(path: str, *a: object, **k: object) -> object:
        assert Path(path).name != "huge.log", "the file over the limit was read"
        return real(path, *a, **k)

    monkeypatch.setattr(readers, "_decoded", no_big_reads)
    steps = [CountsFilter(min_chars=100, max_chars=1_000_000), build_step({"type": "code"})]
    summary = run_pipeline(steps, str(tmp_path / "in"), str(tmp_path / "out"),
                           LocalExecutor(workers=1))
    assert summary["steps"][0]["dropped"] == {"too_many_chars": 1}
    assert summary["skipped"] == 0 and summary["kept"] == 1  # not read: not seen as binary
    assert summary["input_records"] == 2 == summary["kept"] + summary["dropped"]
    assert summary["samples"]["dropped"]["counts: too_many_chars"][0]["id"] == "huge.log"


def test_a_large_file_is_read_in_bounded_memory(tmp_path: Path) -> None:
    ascii_big = tmp_path / "big.txt"  # 3 MB: under 4 bytes a character, so it must be read
    ascii_big.write_text(("All work and no play makes a dull day. " * 26 + "\n") * 3000)
    tracemalloc.start()
    docs = list(read_shard(Shard(str(ascii_big)), ReadReport(), max_chars=1_000_000))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(docs) == 1 and isinstance(docs[0], TooLong)
    assert docs[0].chars_at_least > 1_000_000 and peak < 2.5 * (1 << 20) + 1_500_000
    wide = tmp_path / "wide.txt"  # 2.4 MB of 3-byte characters: 800,000 characters, kept
    wide.write_text("漢字かな" * 200_000, encoding="utf-8")
    (doc,) = read_shard(Shard(str(wide)), ReadReport(), max_chars=1_000_000)
    assert not isinstance(doc, TooLong) and len(doc.text) == 800_000
