"""The commands a user can copy from README.md and docs/*.md, found the way a reader finds them.

**Which text is a command.** Fenced code blocks only (```` ``` ````), read in document order:

- a block tagged `bash`, `sh`, `shell` or `console`: every line is a command (in a `console`
  block only the lines starting with `$ `; the lines after one are its expected output);
- an untagged block: the lines whose first word (after a `$ ` prompt and `NAME=value`
  assignments) is a program a user runs (`PROGRAMS`); a `$ ` line's following lines are its
  expected output, and the other lines of such a block (a diagram, an output sample) are text;
- a block tagged `python`: the whole block is one script, run with the test's interpreter;
- any other tag (`text`, `toml`, `json`, ...) is never run. A usage synopsis (`DIR`,
  `[--flag X]` placeholders) or a printed result is tagged `text` for that reason.

A line ending in `\\` continues on the next one. Comments stay in the command (bash drops them).

**Directives** are HTML comments (invisible in the rendered page, visible in its source) placed
between the previous block and the block they govern; several may precede one block:

- `<!-- doc-test: skip REASON -->`: none of the block's commands is run; REASON says why (not
  runnable on a CPU, a download, minutes of a benchmark, run by another named test);
- `<!-- doc-test: skip "TEXT": REASON -->`: the block's commands that contain TEXT are not run.
  A TEXT that matches none of the block's commands is an error, so no mark outlives its command;
- `<!-- doc-test: exit N -->`: the block's commands must exit with status N (default 0);
  `exit N,M "TEXT": REASON` for the block's commands containing TEXT, with either status;
- `<!-- doc-test: file NAME -->`: the block is the file NAME a command of the doc reads (a
  pipeline TOML, say); it is written into the doc's folder before the doc's commands run.

A directive that does not parse, or is followed by no block, is an error.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

SHELL_TAGS = frozenset({"bash", "sh", "shell", "console"})
PROGRAMS = frozenset({
    "scaletrain", "torchrun", "python", "python3", "pip", "make", "lm_eval", "nsys", "pytest",
    "curl", "export", "source", ".", "cd", "tensorboard",
})
_FENCE = re.compile(r"^(`{3,})(\S*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
_DIRECTIVE = re.compile(r"<!--\s*doc-test:(.*?)-->", re.S)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")


class DocSyntaxError(ValueError):
    """A directive that cannot be read or applied (the test reports it as a failure)."""


@dataclass
class Directives:
    skip_all: str | None = None
    skip_matching: dict[str, str] = field(default_factory=dict)  # TEXT -> REASON
    exit_codes: dict[str | None, frozenset[int]] = field(default_factory=dict)  # TEXT|None -> codes
    file_name: str | None = None


@dataclass
class DocCommand:
    """One command (a shell line, or a python block as one script) of one doc."""

    doc: str  # path relative to the repository, e.g. docs/data.md
    line: int  # 1-based line of the command in the doc
    text: str  # as written (continuation lines joined with a space)
    kind: str  # "shell" or "python"
    exit_codes: frozenset[int] = frozenset({0})
    skip_reason: str | None = None
    expected_output: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass
class Doc:
    path: str
    commands: list[DocCommand]
    files: dict[str, str]  # NAME -> content, from `file` directives


def _parse_directive(body: str, where: str, into: Directives) -> None:
    body = " ".join(body.split())
    if m := re.fullmatch(r'skip "([^"]+)":\s*(.+)', body):
        into.skip_matching[m.group(1)] = m.group(2)
    elif m := re.fullmatch(r"skip\s+(?!\")(.+)", body):
        into.skip_all = m.group(1)
    elif m := re.fullmatch(r'exit\s+(\d+(?:,\d+)*)(?:\s+"([^"]+)")?(?::\s*.+)?', body):
        into.exit_codes[m.group(2)] = frozenset(int(c) for c in m.group(1).split(","))
    elif m := re.fullmatch(r"file\s+(\S+)", body):
        into.file_name = m.group(1)
    else:
        raise DocSyntaxError(f"{where}: cannot read the directive `doc-test: {body}` (see "
                             "tests/helpers/doc_commands.py for the forms)")


def first_word(line: str) -> str:
    """The program a shell line runs: after a `$ ` prompt and `NAME=value` assignments."""
    text = line.strip()
    if text.startswith("$ "):
        text = text[2:]
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        words = text.split()
    while words and _ASSIGNMENT.match(words[0]):
        words = words[1:]
    return words[0] if words else ""


def _logical_lines(body: str) -> list[tuple[int, str]]:
    """(offset of the first physical line, text) with `\\` continuations joined."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for i, raw in enumerate(body.split("\n")):
        if not pending:
            start = i
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1].rstrip())
            continue
        pending.append(raw.strip() if pending else raw.rstrip())
        out.append((start, " ".join(p.strip() if k else p for k, p in enumerate(pending))))
        pending = []
    if pending:
        out.append((start, " ".join(pending)))
    return out


def _shell_commands(tag: str, body: str, first_line: int, doc: str) -> list[DocCommand]:
    cmds: list[DocCommand] = []
    prompted = any(line.startswith("$ ") for line in body.splitlines())
    for offset, text in _logical_lines(body):
        stripped = text.strip()
        is_prompt = stripped.startswith("$ ")
        if tag == "console" or (prompted and not tag):
            if is_prompt:
                cmds.append(DocCommand(doc, first_line + offset, stripped[2:], "shell"))
            elif cmds and stripped:
                cmds[-1].expected_output.append(stripped)
            continue
        if not stripped or stripped.startswith("#"):
            continue
        if tag or first_word(stripped) in PROGRAMS:
            cmds.append(DocCommand(doc, first_line + offset, stripped, "shell"))
    return cmds


def parse_doc(text: str, doc: str) -> Doc:
    """Every command of one markdown text, with its directives applied."""
    commands: list[DocCommand] = []
    files: dict[str, str] = {}
    last_end = 0
    for m in _FENCE.finditer(text):
        tag, body = m.group(2).lower(), m.group(3)
        line = text.count("\n", 0, m.start()) + 1
        where = f"{doc}:{line}"
        directives = Directives()
        for d in _DIRECTIVE.finditer(text, last_end, m.start()):
            _parse_directive(d.group(1), where, directives)
        last_end = m.end()
        if directives.file_name:
            files[directives.file_name] = body
            continue
        if tag in SHELL_TAGS or not tag:
            block = _shell_commands(tag, body, line + 1, doc)
        elif tag == "python":
            block = [DocCommand(doc, line + 1, body, "python")]
        else:
            block = []
        if (directives.skip_all or directives.skip_matching or directives.exit_codes) and not block:
            raise DocSyntaxError(f"{where}: a doc-test directive precedes a block with no command")
        for text_, reason in directives.skip_matching.items():
            hits = [c for c in block if text_ in c.text]
            if not hits:
                raise DocSyntaxError(f'{where}: `skip "{text_}"` matches no command of the block '
                                     "after it (remove the mark, or fix its text)")
            for c in hits:
                c.skip_reason = reason
        for text_, codes in directives.exit_codes.items():
            hits = [c for c in block if text_ is None or text_ in c.text]
            if not hits:
                raise DocSyntaxError(f'{where}: `exit ... "{text_}"` matches no command of the '
                                     "block after it")
            for c in hits:
                c.exit_codes = codes
        for c in block:
            if directives.skip_all:
                c.skip_reason = directives.skip_all
        commands += block
    if _DIRECTIVE.search(text, last_end):
        raise DocSyntaxError(f"{doc}: a doc-test directive after the last block governs nothing")
    return Doc(doc, commands, files)


def doc_paths(root: Path) -> list[Path]:
    """README.md and every docs/*.md, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
