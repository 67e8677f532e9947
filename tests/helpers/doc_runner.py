"""Runs the commands of one doc (tests/helpers/doc_commands.py finds them) in a fresh folder, in
order.

**The folder.** `<tmp>/repo` holds links to the repository's `scaletrain/`, `constraints.txt` and
`pyproject.toml`, and folders `tests/` and `bench/` whose entries link to the repository's
(but `bench/results/`, so a benchmark writes its results in the folder): what commands name by
relative path, and nothing else;
`<tmp>/shared` links to the fixtures' `shared/` folder when it is found, so
`../shared/fixtures/...` resolves as it does from a checkout. Every command of one doc runs
there, in document order, sharing what the earlier ones wrote: a recipe must chain as written.
`PATH` starts with this interpreter's folder (its `scaletrain`, `torchrun`, `python`),
`PYTHONPATH` with the repository, the hub is offline, and `SCALETRAIN_CACHE` is one cache
shared by the whole test session (the built-in corpus is built once).

**Inputs a doc names as the reader's own** (`my_repo/`, `chat.jsonl`, ...) are made in the
folder before its commands run: `tests/helpers/doc_inputs.py` lists them per doc, with what each
holds.

**Substitutions** (`tests/helpers/doc_inputs.py: SUBSTITUTIONS`) make sizes small enough for a CPU
test: each is a named rule with its reason, matched against the command as written, and a command
it changed is reported as *adapted*, with the rule's name, next to the text that actually ran.
No other change is made to a command. `scaletrain serve` is started in the background on a free
port (the doc's port, default 8000, is rewritten to it in the doc's later commands) and
stopped when the doc is done.

Each command is then *ran* (as written), *adapted*, *marked* (a `doc-test: skip` with its
reason; not run) or *failed* (a non-zero exit other than the one the doc expects, a missing
expected output line, or a time-out). An unmarked command that would install packages
(`pip install`) or start more than `MAX_PROCESSES` processes fails without being run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.doc_commands import Doc, DocCommand, first_word
from tests.helpers.doc_inputs import INPUTS, SUBSTITUTIONS, Env, make_inputs

REPO = Path(__file__).resolve().parents[2]
LINKED = ("scaletrain", "constraints.txt", "pyproject.toml")
MIRRORED = {"bench": {"results"}, "tests": {"__pycache__"}}  # their entries linked, but these
COMMAND_TIMEOUT_S = 300
MAX_PROCESSES = 4  # a command that would start more (torchrun --nproc_per_node 8) is not run
SERVER_START_TIMEOUT_S = 120


def shared_dir() -> Path | None:
    """The `shared/` folder beside the repository (it holds `fixtures/`), if there is one."""
    for c in (os.environ.get("SCALETRAIN_FIXTURES", ""), str(REPO.parent / "shared" / "fixtures"),
              "/work/shared/fixtures"):
        if c and (Path(c) / "data" / "README.md").exists():
            return Path(c).resolve().parent
    return None


@dataclass
class Outcome:
    command: DocCommand
    status: str  # ran | adapted | marked | failed
    ran_as: str = ""
    changes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    detail: str = ""


def strip_comment(command: str) -> str:
    """The command without a trailing `# comment` (outside quotes), so arguments can follow."""
    quote = ""
    for i, ch in enumerate(command):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command


def adapt(command: str) -> tuple[str, list[str]]:
    """The command with every matching substitution applied, and the names of those rules."""
    changes: list[str] = []
    for rule in SUBSTITUTIONS:
        if rule.applies(command):
            command = rule.apply(strip_comment(command))
            changes.append(rule.name)
    return command, changes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(text: str, n: int = 2500) -> str:
    return text if len(text) <= n else "..." + text[-n:]


class DocRun:
    """One doc's commands in one fresh folder (see the module docstring)."""

    def __init__(self, doc: Doc, tmp: Path, cache: Path, repo: Path = REPO,
                 timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.doc = doc
        self.cache = cache
        self.timeout_s = timeout_s
        self.root = tmp
        self.cwd = tmp / "repo"
        self.cwd.mkdir(parents=True)
        for name in LINKED:
            (self.cwd / name).symlink_to(repo / name)
        for name, keep_out in MIRRORED.items():  # a real folder: what runs there writes here
            (self.cwd / name).mkdir()
            for entry in (repo / name).iterdir():
                if entry.name not in keep_out:
                    (self.cwd / name / entry.name).symlink_to(entry)
        shared = shared_dir()
        if shared is not None:
            (tmp / "shared").symlink_to(shared)
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "SCALETRAIN_CACHE": str(cache),
            "PYTHONUNBUFFERED": "1",
        }
        self.servers: list[subprocess.Popen[bytes]] = []
        self.ports: dict[str, str] = {}  # the doc's port -> the free one the server got
        self.carried: list[str] = []  # `export` / `cd` / `source` lines, kept for later commands

    def run_all(self) -> list[Outcome]:
        make_inputs(INPUTS.get(self.doc.path, ()),
                    Env(self.cwd, shared_dir(), self.env, self.cache / "inputs"))
        for name, content in self.doc.files.items():
            path = self.cwd / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        try:
            return [self.run_one(c) for c in self.doc.commands]
        finally:
            self.stop_servers()

    def _rewrite_ports(self, text: str) -> tuple[str, list[str]]:
        changes = []
        for old, new in self.ports.items():
            pattern = rf"((?:127\.0\.0\.1|localhost):){old}\b"
            if re.search(pattern, text):
                text = re.sub(pattern, rf"\g<1>{new}", text)
                changes.append(f"port {old} -> the test server's free port {new}")
        return text, changes

    def run_one(self, cmd: DocCommand) -> Outcome:
        if cmd.skip_reason:
            return Outcome(cmd, "marked", detail=cmd.skip_reason)
        text, changes = (cmd.text, []) if cmd.kind == "python" else adapt(cmd.text)
        text, port_changes = self._rewrite_ports(text)
        changes += port_changes
        if cmd.kind == "shell" and re.search(r"(^|\s)(pip3?|python3? -m pip)\s+install\b", text):
            return Outcome(cmd, "failed", text, changes, detail=(
                "not run: it installs packages into the test's environment; mark it "
                "(doc-test: skip) with the reason"))
        nproc = re.search(r"--nproc[_-]per[_-]node[ =](\d+)", text)
        if nproc and int(nproc.group(1)) > MAX_PROCESSES:
            return Outcome(cmd, "failed", text, changes, detail=(
                f"not run: it starts {nproc.group(1)} processes, the runner at most "
                f"{MAX_PROCESSES}; mark it (doc-test: skip) with the reason"))
        start = time.perf_counter()
        if cmd.kind == "shell" and text.split()[:2] == ["scaletrain", "serve"]:
            return self._start_server(cmd, text, changes, start)
        if cmd.kind == "python":
            script = self.cwd / f"_doc_snippet_{cmd.line}.py"
            script.write_text(text)
            argv = [sys.executable, script.name]
        else:
            argv = ["bash", "-c", "\n".join([*self.carried, text])]
            if first_word(text) in ("export", "cd", "source", "."):
                self.carried.append(text)
        proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the command and everything it started
            stdout, stderr = proc.communicate()
            return Outcome(cmd, "failed", text, changes, time.perf_counter() - start,
                           f"timed out after {self.timeout_s:.0f} s\n{_tail(stdout + stderr)}")
        seconds = time.perf_counter() - start
        output = stdout + stderr
        problems = []
        if proc.returncode not in cmd.exit_codes:
            want = " or ".join(str(c) for c in sorted(cmd.exit_codes))
            problems.append(f"exit {proc.returncode}, the doc expects {want}")
        for line in cmd.expected_output:
            want = line.split("...")[0].strip()
            if want and want not in output:
                problems.append(f"expected output line not printed: {line!r}")
        status = "failed" if problems else ("adapted" if changes else "ran")
        detail = "\n".join(problems + [_tail(output)]) if problems else ""
        return Outcome(cmd, status, text, changes, seconds, detail)

    def _start_server(self, cmd: DocCommand, text: str, changes: list[str],
                      start: float) -> Outcome:
        m = re.search(r"--port[ =](\d+)", text)
        old = m.group(1) if m else "8000"
        port = str(_free_port())
        text = (re.sub(r"--port[ =]\d+", f"--port {port}", text) if m
                else f"{strip_comment(text)} --port {port}")
        changes = [*changes, f"serve: started in the background on free port {port} "
                             f"(the doc's {old} is rewritten in its later commands)"]
        log = (self.root / f"server-{port}.log").open("wb")
        proc = subprocess.Popen(["bash", "-c", f"exec {strip_comment(text)}"], cwd=self.cwd,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.servers.append(proc)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    self.ports[old] = port
                    return Outcome(cmd, "adapted", text, changes, time.perf_counter() - start)
            except OSError:
                time.sleep(0.3)
        out = (self.root / f"server-{port}.log").read_text(errors="replace")
        return Outcome(cmd, "failed", text, changes, time.perf_counter() - start,
                       f"the server did not answer /health (exit {proc.poll()})\n{_tail(out)}")

    def stop_servers(self) -> None:
        for proc in self.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def run_doc(doc: Doc, tmp: Path, cache: Path, repo: Path = REPO,
            timeout_s: float = COMMAND_TIMEOUT_S) -> list[Outcome]:
    """Every command of `doc`, in a fresh folder under `tmp` (removed when they pass)."""
    folder = tmp / re.sub(r"[^A-Za-z0-9]+", "_", doc.path)
    outcomes = DocRun(doc, folder, cache, repo, timeout_s).run_all()
    if all(o.status != "failed" for o in outcomes):
        shutil.rmtree(folder, ignore_errors=True)
    return outcomes


def format_table(outcomes: list[Outcome]) -> str:
    """One line per command: where, status, seconds, the rule or reason; then the totals."""
    lines = []
    for o in outcomes:
        note = ", ".join(o.changes) if o.status == "adapted" else o.detail.split("\n")[0]
        lines.append(f"{o.command.where:<24} {o.status:<8} {o.seconds:6.1f}s  "
                     f"{o.command.text.splitlines()[0][:90]}")
        if note:
            lines.append(f"{'':<42}{note}")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ran", "adapted", "marked",
                                                               "failed")}
    lines.append(" / ".join(f"{k} {v}" for k, v in counts.items())
                 + f"  ({len(outcomes)} commands, {sum(o.seconds for o in outcomes):.0f} s)")
    return "\n".join(lines)
