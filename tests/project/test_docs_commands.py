"""Docs that run: every command a reader can copy from README.md and docs/*.md is run here, one
fresh folder per doc, in document order (a recipe must chain as written), or is marked in the
doc as not run with its reason. An unmarked command that fails fails its doc's test case.

The rules (what counts as a command, the `doc-test:` markers, the inputs made for a doc and the
substitutions that shrink sizes) are in tests/helpers/doc_commands.py, tests/helpers/doc_runner.py
and tests/helpers/doc_inputs.py, and summed up for doc writers in docs/doc-tests.md. The table of
every command (ran / adapted / marked / failed): `python bench/docs_commands.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.doc_commands import DocSyntaxError, doc_paths, parse_doc
from tests.helpers.doc_runner import REPO, format_table, run_doc, shared_dir

DOCS = doc_paths(REPO)


@pytest.fixture(scope="module")
def doc_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus/tokenizer cache for every doc (the small built-in corpus is built once)."""
    return tmp_path_factory.mktemp("doc-cache")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_doc_commands_run_as_written(path: Path, tmp_path: Path, doc_cache: Path) -> None:
    doc = parse_doc(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    if shared_dir() is None and any("shared/fixtures" in c.text for c in doc.commands):
        pytest.skip("shared/fixtures not found (set SCALETRAIN_FIXTURES to shared/fixtures)")
    try:
        outcomes = run_doc(doc, tmp_path, doc_cache)
    except FileNotFoundError as e:  # an input made from the fixtures (tests/helpers/doc_inputs.py)
        if shared_dir() is None:
            pytest.skip(str(e))
        raise
    failed = [o for o in outcomes if o.status == "failed"]
    assert not failed, "\n\n".join(
        f"{o.command.where}: {o.ran_as or o.command.text}\n{o.detail}" for o in failed
    ) + "\n\n" + format_table(outcomes)


def test_every_doc_has_been_found() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "data.md", "curate.md", "serve.md", "train.md"} <= names


# ------------------------------------------------------- the extraction rule and the markers
_DOC = """\
Intro.

```bash
scaletrain models   # a comment
scaletrain plan --model debug \\
    --seq-len 64 --mbs 1
```

```
scaletrain serve --checkpoint DIR [--port 8000]
a diagram line
```

```text
scaletrain serve --checkpoint DIR [--port 8000]
```

<!-- doc-test: skip "torchrun": needs 8 processes -->
<!-- doc-test: exit 0,3 "dry-run": 3 where it does not fit -->
```bash
torchrun --nproc_per_node 8 -m scaletrain train
scaletrain train --dry-run
```

```
$ scaletrain train --optimizer.lr -1
scaletrain train: invalid config:
  - optimizer.lr must not be negative (got -1.0)
```

<!-- doc-test: file pipeline.toml -->
```toml
output = "x"
```

```python
print("hi")
```
"""


def test_extraction_rule_and_markers() -> None:
    doc = parse_doc(_DOC, "x.md")
    got = [(c.line, c.kind, c.text.split("\n")[0]) for c in doc.commands]
    assert got == [
        (4, "shell", "scaletrain models   # a comment"),
        (5, "shell", "scaletrain plan --model debug --seq-len 64 --mbs 1"),
        (10, "shell", "scaletrain serve --checkpoint DIR [--port 8000]"),  # untagged: a command
        (21, "shell", "torchrun --nproc_per_node 8 -m scaletrain train"),
        (22, "shell", "scaletrain train --dry-run"),
        (26, "shell", "scaletrain train --optimizer.lr -1"),
        (37, "python", 'print("hi")'),
    ]
    by_line = {c.line: c for c in doc.commands}
    assert by_line[21].skip_reason == "needs 8 processes"
    assert by_line[22].skip_reason is None and by_line[22].exit_codes == {0, 3}
    assert by_line[26].expected_output == ["scaletrain train: invalid config:",
                                           "- optimizer.lr must not be negative (got -1.0)"]
    assert doc.files == {"pipeline.toml": 'output = "x"\n'}


@pytest.mark.parametrize("bad, message", [
    ('<!-- doc-test: skip "nothing like it": gone -->\n```bash\nscaletrain models\n```\n',
     "matches no command"),
    ("<!-- doc-test: skp typo -->\n```bash\nscaletrain models\n```\n", "cannot read"),
    ("<!-- doc-test: skip why -->\n```text\nnot a command\n```\n", "no command"),
    ("```bash\nscaletrain models\n```\n<!-- doc-test: skip dangling -->\n", "governs nothing"),
])
def test_a_marker_that_does_not_apply_is_an_error(bad: str, message: str) -> None:
    with pytest.raises(DocSyntaxError, match=message):
        parse_doc(bad, "x.md")


def test_an_unmarked_failing_command_fails_and_a_marked_one_is_not_run(tmp_path: Path) -> None:
    doc = parse_doc("```bash\nscaletrain no-such-verb\n```\n\n"
                    "<!-- doc-test: skip never run -->\n```bash\nscaletrain train\n```\n\n"
                    "```bash\ntorchrun --nproc_per_node 16 -m scaletrain train\n```\n", "x.md")
    outcomes = run_doc(doc, tmp_path, tmp_path / "cache")
    assert [o.status for o in outcomes] == ["failed", "marked", "failed"]
    assert "exit 2" in outcomes[0].detail
    assert "starts 16 processes" in outcomes[2].detail and outcomes[2].seconds == 0


def test_a_recipe_shares_its_folder_and_expected_output_is_checked(tmp_path: Path) -> None:
    doc = parse_doc("```bash\nexport GREETING=hello\necho $GREETING > made.txt\n"
                    "python -c \"print(open('made.txt').read())\"\n```\n\n"
                    "<!-- doc-test: exit 2 -->\n```console\n"
                    "$ scaletrain train --optimizer.lr -1\nmust not be negative\n$ python -c "
                    "\"import sys; sys.exit(2)\"\nnever printed\n```\n", "x.md")
    outcomes = run_doc(doc, tmp_path, tmp_path / "cache")
    assert [o.status for o in outcomes] == ["ran", "ran", "ran", "adapted", "failed"]
    assert (tmp_path / "x_md" / "repo" / "made.txt").read_text() == "hello\n"
    assert "expected output line not printed: 'never printed'" in outcomes[4].detail


def test_every_substitution_and_input_is_written_down_for_doc_writers() -> None:
    from tests.helpers.doc_inputs import INPUTS, MAKERS, SUBSTITUTIONS

    guide = (REPO / "docs" / "doc-tests.md").read_text(encoding="utf-8")
    for rule in SUBSTITUTIONS:
        assert f"| {rule.name} |" in guide, f"substitution {rule.name!r} is not in the table"
        assert rule.append in guide or not rule.append, rule.name
    for names in INPUTS.values():
        for name in names:
            assert MAKERS[name].__doc__, f"input {name!r} says nothing about what it holds"
