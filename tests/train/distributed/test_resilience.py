"""A long run survives what clusters do to it, under torchrun with 2 ranks on CPU (gloo):

- a rank killed (SIGKILL) at three different steps of one run: torchrun restarts the ranks,
  each start resumes from the newest checkpoint (`checkpoint.resume auto`), and the final
  weights, optimizer and data state and every step's loss equal an uninterrupted run's bit for
  bit (written by the background checkpoint writer, compared with the synchronous one's);
- SIGTERM to torchrun mid-run: the ranks checkpoint at the next step and exit 75, leaving
  `preempted.json`; running the same command again finishes the run, equal to the
  uninterrupted one;
- a rank stopped with SIGSTOP: the other fails within the step timeout, naming it and its last
  step, with its own Python stack written to `<output>/stacks/`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.proc import scaled
from tests.helpers.trainer import tiny_argv

ROOT = Path(__file__).resolve().parents[3]
STEPS = 10
RUN = ["--training.steps", str(STEPS), "--checkpoint.interval", "2", "--checkpoint.keep_last",
       "3", "--parallel.data_parallel", "zero3", "--training.eval_sequences", "4",
       "--training.micro_batch_size", "2", "--training.grad_accum_steps", "2"]  # accumulation on


def torchrun(out: Path, cache: Path, *driver: str, restarts: int = 0, extra: tuple = (),
             log: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--max_restarts", str(restarts), "--shutdown_timeout", "5",
           "-m", "tests.helpers.resilience_driver", *driver, "--train",
           *tiny_argv(out, cache, *RUN, *extra)]
    # Each restart gets a fresh rendezvous store: with torchrun's shared one a restarted gloo
    # group reads the previous start's addresses (pytorch/pytorch#135712).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log or out.with_suffix(".log"), "w") as err:  # a file: an unread pipe would stall
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=err, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc: subprocess.Popen, out: Path, limit_s: float = 240) -> int:
    """The launch's exit code; then no process of the run outlives it (torchrun starts each
    rank in a session of its own, so a rank it failed to stop would linger: matched by the
    run's output path on its command line)."""
    try:
        return proc.wait(timeout=scaled(limit_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        subprocess.run(["pkill", "-KILL", "-f", "--", f"--output {out}( |$)"], check=False)


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, log: Path) -> None:
    """Until `out/metrics.jsonl` holds `steps` steps (the run must still be going)."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + scaled(180)
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def final_state(out: Path) -> dict[str, str]:
    """Content hashes of the final checkpoint's DCP shards (model, optimizer, data position,
    RNG and schedule of every rank)."""
    manifest = json.loads((out / "checkpoints" / f"step-{STEPS:07d}" / "manifest.json")
                          .read_text())
    return {k: v["xxh3_128"] for k, v in manifest["files"].items() if k.endswith(".distcp")}


def losses(out: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The uninterrupted run (synchronous checkpoints), and the shared corpus cache."""
    tmp = tmp_path_factory.mktemp("resilience")
    cache = tmp / "cache"
    from scaletrain.train.trainer import Trainer
    from tests.helpers.trainer import tiny_config

    Trainer(tiny_config(tmp / "warm", cache, "--training.steps", "1"))  # the corpus, once
    out = tmp / "reference"
    assert finish(torchrun(out, cache), out) == 0, out.with_suffix(".log").read_text()[-3000:]
    return out, cache


@pytest.mark.distributed
def test_a_rank_killed_three_times_restarts_to_the_uninterrupted_result(
        reference: tuple[Path, Path], tmp_path: Path) -> None:
    ref, cache = reference
    out = tmp_path / "killed"
    proc = torchrun(out, cache, "--kill", "1:3,1:6,1:9", restarts=3,
                    extra=("--checkpoint.async_save", "true"))
    log = out.with_suffix(".log")
    assert finish(proc, out) == 0, log.read_text()[-3000:]
    assert log.read_text().count("(exitcode: -9)") == 3  # three kills, three restarts
    assert final_state(out) == final_state(ref)
    assert losses(out) == losses(ref)


@pytest.mark.distributed
def test_sigterm_to_torchrun_checkpoints_and_the_rerun_finishes_equal(
        reference: tuple[Path, Path], tmp_path: Path) -> None:
    ref, cache = reference
    out = tmp_path / "preempted"
    proc = torchrun(out, cache, "--sleep", "0.4")
    wait_for_steps(proc, out, 3, out.with_suffix(".log"))
    os.kill(proc.pid, signal.SIGTERM)  # what Slurm sends the job step before it kills it
    assert finish(proc, out) != 0
    log = out.with_suffix(".log").read_text()
    marker = json.loads((out / "preempted.json").read_text())
    assert marker["signal"] == "SIGTERM" and 3 <= marker["step"] < STEPS, log[-3000:]
    assert "stopped by SIGTERM after step" in log
    assert Path(marker["checkpoint"]).name == f"step-{marker['step']:07d}"
    assert (Path(marker["checkpoint"]) / "manifest.json").is_file()
    assert finish(torchrun(out, cache, log=tmp_path / "rerun.log"), out) == 0, \
        (tmp_path / "rerun.log").read_text()[-3000:]
    assert not (out / "preempted.json").exists()
    assert final_state(out) == final_state(ref)
    assert losses(out) == losses(ref)


@pytest.mark.distributed
def test_a_stopped_rank_is_named_with_the_stacks_in_the_run_directory(
        reference: tuple[Path, Path], tmp_path: Path) -> None:
    _, cache = reference
    out = tmp_path / "stopped"
    timeout_s = 6
    t0 = time.monotonic()
    proc = torchrun(out, cache, "--stop", "1:4",
                    extra=("--parallel.step_timeout_s", str(timeout_s)))
    assert finish(proc, out, limit_s=120) != 0  # the stopped rank is killed either way
    elapsed = time.monotonic() - t0
    log = out.with_suffix(".log").read_text()
    assert "rank 1 stopped responding (last seen at step 4: training step)" in log, log[-3000:]
    stack = (out / "stacks" / "rank0.txt").read_text()
    assert "Thread" in stack and "trainer.py" in stack, stack[:2000]
    print(f"stopped rank named after {elapsed:.1f} s (step timeout {timeout_s} s)")


FAKE_SLURM = {  # what the script calls, on PATH: srun runs the step here, scontrol records
    "srun": '#!/bin/bash\nexec "$@"\n',
    "scontrol": '#!/bin/bash\nif [ "$1" = show ]; then echo localhost; '
                'else echo "$@" >> "$SCONTROL_LOG"; fi\n',
}


@pytest.mark.distributed
def test_the_slurm_script_requeues_a_preempted_job_which_then_finishes(
        reference: tuple[Path, Path], tmp_path: Path) -> None:
    """`scaletrain launch --slurm`'s script, run by bash with stand-ins for srun and scontrol:
    Slurm's SIGUSR1 to the job step makes the ranks checkpoint, the script requeues the job,
    and the requeued job (the same script again) finishes equal to the uninterrupted run."""
    from scaletrain.cli import main

    ref, cache = reference
    out = tmp_path / "job"
    script = tmp_path / "job.sbatch"
    argv = tiny_argv(out, cache, *RUN)
    assert main(["launch", "--slurm", "--nodes", "1", "--gpus-per-node", "2", "--port", "0",
                 "--out", str(script), "--", *argv]) == 0
    text = script.read_text()
    # Steps slow enough to signal mid-run: the fault driver in place of the CLI (visible here).
    text = text.replace("-m scaletrain train",
                        "-m tests.helpers.resilience_driver --sleep 0.4 --train")
    text = text.replace("--rdzv_endpoint \"$head_node:0\"", "--standalone")
    script.write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "scontrol.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "42", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost",
           "SCONTROL_LOG": str(log), "PYTHONPATH": str(ROOT)}

    def job() -> subprocess.Popen:
        with open(tmp_path / "job.log", "a") as err:
            return subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, stdout=err,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    first = job()
    wait_for_steps(first, out, 3, tmp_path / "job.log")
    # Slurm signals every process of the job step (torchrun and its ranks), not the script.
    subprocess.run(["pkill", "-USR1", "-f", f"tests.helpers.resilience_driver.*{out}"], check=True)
    assert finish(first, out) == 0, (tmp_path / "job.log").read_text()[-3000:]
    assert log.read_text().split() == ["requeue", "42"]
    assert "requeueing job 42" in (tmp_path / "job.log").read_text()
    assert finish(job(), out) == 0, (tmp_path / "job.log").read_text()[-3000:]
    assert log.read_text().split() == ["requeue", "42"]  # not requeued again
    assert final_state(out) == final_state(ref)
    assert losses(out) == losses(ref)
