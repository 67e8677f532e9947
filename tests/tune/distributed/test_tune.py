"""`scaletrain tune` end to end on 2 gloo ranks (the debug model, 32-token sequences): it ends
inside its budget, its winner is the fastest of the trials it measured (re-read from each
trial's metrics.jsonl, not from tune's own figures), a candidate that cannot run and one that
does not fit are reported while the others run, `--resume` runs nothing again, and the command
it writes trains."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.proc import scaled

ROOT = Path(__file__).resolve().parents[3]
BUDGET_MIN = 3.0  # ample: the rounds (2 layouts x 1 variant) end well before it
MEASURE = 1


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _tune(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "scaletrain", "tune", "--nproc", "2", "--budget-minutes",
           str(BUDGET_MIN), "--layouts", "2", "--variants", "1", "--measure-steps", str(MEASURE),
           # cannot run: no CUDA here, or no 100th GPU; its ranks fail at start
           "--candidate=--training.device cuda:99",
           # planned far above the RAM: the dry run refuses it
           "--candidate=--training.micro_batch_size 100000",
           "--data.seq_len", "32", "--training.micro_batch_size", "2",
           "--precision.dtype", "fp32", "--training.device", "cpu", "--output", str(out),
           *extra]
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=scaled(BUDGET_MIN * 60 + 120))
    return p, time.monotonic() - start


def _warm_steps(trial_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (trial_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r["step_time_s"] for r in rows if 2 <= r["step"] <= 1 + MEASURE]


@pytest.mark.distributed
def test_tune_picks_the_fastest_skips_failures_resumes_and_its_command_trains(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    p, wall = _tune(out)
    assert p.returncode == 0, p.stdout + p.stderr
    folder = out / "tune"
    data = json.loads((folder / "tune.json").read_text())
    # inside its budget (the command's whole wall time, interpreter start-up aside)
    assert data["elapsed_s"] <= data["budget_s"]
    assert wall <= BUDGET_MIN * 60 + scaled(15)
    trials = {t["id"]: t for t in data["trials"]}
    by_status = {}
    for t in data["trials"]:
        by_status.setdefault(t["status"], []).append(t)
    # the candidate that cannot run failed, the one that cannot fit was skipped; both reported
    failed = [t for t in data["trials"] if "device" in " ".join(t["flags"])]
    assert failed and failed[0]["status"] == "failed", failed
    assert "cuda" in failed[0]["message"].lower()
    huge = [t for t in data["trials"] if "100000" in t["flags"]]
    assert huge[0]["status"] == "skipped" and "does not fit" in huge[0]["skip_reason"]
    assert "failed:" in p.stdout and "skipped:" in p.stdout
    # the others ran: the winner is the fastest measured, re-read from the trials' own metrics
    measured = {i: _warm_steps(folder / "trials" / i) for i, t in trials.items()
                if t["status"] in ("ok", "stopped")}
    assert len(measured) >= 2
    win = data["winner"]
    assert trials[win]["status"] == "ok"
    best = statistics.median(measured[win])
    for i, steps in measured.items():
        assert best <= statistics.median(steps) + 1e-9, (win, i, measured)
    assert trials[win]["verdict"], trials[win]  # diagnosed from its traces
    assert (folder / "trials" / win / "profile" / "diagnosis.json").exists()
    html = (folder / "tune.html").read_text()
    assert "<svg" in html and win[:4] in html
    # --resume: every finished trial is taken from tune.json, none is run again
    logs = {i: (folder / "trials" / i / "trial.log").stat().st_mtime_ns for i in measured}
    p2, _ = _tune(out, "--resume")
    assert p2.returncode == 0, p2.stdout + p2.stderr
    again = json.loads((folder / "tune.json").read_text())
    assert again["winner"] == win
    assert {t["id"] for t in again["trials"]} == set(trials)
    assert all(t["reused"] for t in again["trials"])
    assert logs == {i: (folder / "trials" / i / "trial.log").stat().st_mtime_ns for i in logs}
    # the written command trains (2 steps of it)
    command = (folder / "winner.sh").read_text().splitlines()[-1]
    argv = shlex.split(command)
    assert argv[0] == "torchrun"
    run = tmp_path / "winner-run"
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:], "--training.steps", "2",
            "--output", str(run), "--checkpoint.save_final", "false",
            "--training.eval_interval", "0", "--training.sample_tokens", "0",
            "--metrics.tensorboard", "false"]
    t = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=scaled(180))
    assert t.returncode == 0, t.stdout + t.stderr
    steps = (run / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2
    from scaletrain.config import read_toml

    ran = read_toml(run / "config.toml")
    flags = dict(zip(trials[win]["flags"][::2], trials[win]["flags"][1::2]))
    assert ran.training.micro_batch_size == int(flags["--training.micro_batch_size"])
    assert ran.activation_checkpoint.mode == flags["--activation_checkpoint.mode"]
    assert str(ran.training.fused_loss).lower() == flags["--training.fused_loss"]
