"""The default pipeline is chosen per file: in a source tree with a package.json and an HTML
page, the source files get the code rules (and keep what they keep without the web files
beside them), the HTML page the web rules, and package.json is one document, not JSON
lines."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from scaletrain.commands import data as data_cmd
from scaletrain.curate.io.readers import plan_shards, sniff_format
from tests.helpers.curate import read_output, write_jsonl

PACKAGE_JSON = {
    "name": "my-repo-frontend", "version": "1.4.2", "private": True,
    "description": "The web front end of the repository: a small single-page application.",
    "scripts": {"build": "vite build", "test": "vitest run", "lint": "eslint src"},
    "dependencies": {"react": "^18.2.0", "react-dom": "^18.2.0"},
    "devDependencies": {"vite": "^5.0.0", "vitest": "^1.0.0", "eslint": "^8.50.0"},
}
PAGE = """<!doctype html><html><head><title>Project notes</title></head><body><main><article>
<h1>How the build works</h1>
<p>The project is built in two steps. First the Python package is installed in a fresh
virtual environment, then the front end is compiled into static files that the package
serves. Each step writes a log that the continuous integration keeps for a week.</p>
<p>When a step fails, read its log from the top: the first error is usually the one that
matters, and the later ones follow from it. Most failures come from a missing system
library or from a version of a dependency that changed its interface without warning.</p>
</article></main></body></html>
"""


def _stdlib_part(dest: Path) -> list[str]:
    """A real source tree: the standard library's json and email packages."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    for pkg in ("json", "email"):
        shutil.copytree(lib / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())


def test_json_lines_or_one_json_document_by_content(tmp_path: Path) -> None:
    (tmp_path / "package.json").write_text(json.dumps(PACKAGE_JSON, indent=2))
    (tmp_path / "one-line.json").write_text(json.dumps({"name": "x", "version": "1"}))
    write_jsonl(tmp_path / "docs.json", [{"text": "one"}, {"text": "two"}])
    write_jsonl(tmp_path / "data.jsonl", [{"text": "three"}])
    assert [sniff_format(str(tmp_path / n)) for n in
            ("package.json", "one-line.json", "docs.json", "data.jsonl")] == \
        ["text", "text", "jsonl", "jsonl"]
    kinds = {Path(s.path).name: s.format for s in plan_shards(str(tmp_path))}
    assert kinds["package.json"] == "text" and kinds["docs.json"] == "jsonl"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("mixed")
    code_only, mixed = base / "code_only", base / "my_repo"
    files = _stdlib_part(code_only)
    shutil.copytree(code_only, mixed)
    (mixed / "package.json").write_text(json.dumps(PACKAGE_JSON, indent=2))
    (mixed / "docs").mkdir()
    (mixed / "docs" / "notes.html").write_text(PAGE)
    (mixed / "docs" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    (mixed / "libfast.a").write_bytes(b"!<arch>\n" + bytes(range(256)) * 40)
    out = {"files": files}
    for name, src in (("code_only", code_only), ("mixed", mixed)):
        argv = ["curate", "--input", str(src), "--output", str(base / f"out_{name}"),
                "--workers", "1", "--json"]
        import contextlib
        import io

        err, std = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            assert data_cmd.main(argv) == 0
        out[name] = {"summary": json.loads(std.getvalue()), "log": err.getvalue(),
                     "kept": {d["id"] for d in read_output(base / f"out_{name}")}}
    return out


def test_code_files_keep_what_they_keep_alone(runs: dict) -> None:
    code, mixed = runs["code_only"], runs["mixed"]
    kept_tree = mixed["kept"] - {"package.json", "docs/notes.html"}
    assert kept_tree == code["kept"]  # the web files beside them change nothing
    assert len(code["kept"]) >= 0.8 * len(runs["files"])  # a repository keeps most files
    assert "package.json" in mixed["kept"]  # one document, read as a source file


def test_the_log_and_the_steps_state_the_choice(runs: dict) -> None:
    prose = [f for f in runs["files"] if f.endswith(".rst")]  # email/architecture.rst
    assert prose == ["email/architecture.rst"]
    n_text = len(runs["files"]) - 1 + 1 + 2  # the .py files, package.json, the two binaries
    assert (f"default pipeline: code rules for {n_text} source/text files, web rules for 2 "
            "web-document files (1 html, 1 prose)") in runs["mixed"]["log"]
    steps = {s["name"]: s for s in runs["mixed"]["summary"]["steps"]}
    assert steps["language"]["seen"] == 2  # only the HTML page and the prose file
    assert steps["counts"]["seen"] == len(runs["files"])  # the code files and package.json
    assert "[code only]" in steps["code"]["settings"]
    assert "[web only]" in steps["gopher_quality"]["settings"]


def test_binaries_are_skipped_and_every_file_is_accounted_for(runs: dict) -> None:
    s = runs["mixed"]["summary"]
    assert s["skipped_reasons"] == {"binary files": 2}
    assert s["input_records"] == len(runs["files"]) + 4  # + package.json, html, png, .a
    assert s["kept"] + s["dropped"] + s["malformed"] + s["skipped"] == s["input_records"]
    assert not {"docs/logo.png", "libfast.a"} & runs["mixed"]["kept"]


def test_only_limits_a_step_to_one_kind_and_is_checked(tmp_path: Path) -> None:
    from scaletrain.curate.registry import build_step
    from scaletrain.curate.runner import run_pipeline

    src = tmp_path / "src"
    (src / "docs").mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")  # 6 characters
    write_jsonl(src / "docs" / "d.jsonl", [{"text": "short"}, {"text": "y" * 50}])
    steps = [build_step({"type": "counts", "min_chars": 10, "only": "web"})]
    s = run_pipeline(steps, str(src), str(tmp_path / "o"))
    assert s["steps"][0]["seen"] == 2 and s["kept"] == 2  # a.py passes by, unjudged
    assert {d["text"] for d in read_output(tmp_path / "o")} == {"x = 1\n", "y" * 50}
    with pytest.raises(ValueError, match="only ="):
        build_step({"type": "counts", "only": "prose"})
    late = [build_step({"type": "exact_dedup"}), build_step({"type": "exact_dedup"}),
            build_step({"type": "counts", "only": "code"})]
    with pytest.raises(ValueError, match="before the first deduplication step"):
        run_pipeline(late, str(src), str(tmp_path / "o2"))
