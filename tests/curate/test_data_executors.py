"""Executors: a run killed mid-way and re-run gives exactly the uninterrupted output; Ray
gives the same output as local processes."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from scaletrain.curate.dedup import ExactDedup, MinHashDedup
from scaletrain.curate.documents import Document
from scaletrain.curate.executors import LocalExecutor
from scaletrain.curate.filters import CountsFilter, GopherRepetitionFilter
from scaletrain.curate.pii import PIIRedactor
from scaletrain.curate.pipeline import Step
from scaletrain.curate.runner import RunOptions, run_pipeline
from tests.helpers.curate import write_jsonl


class KillOnce(Step):
    """Kills its worker process (SIGKILL, like the OOM killer) at one document, once."""

    name = "kill_once"

    def __init__(self, doc_id: str, flag: str):
        super().__init__()
        self.doc_id, self.flag = doc_id, flag

    def process(self, doc: Document) -> Document:
        if doc.id == self.doc_id and not os.path.exists(self.flag):
            Path(self.flag).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return doc


def _corpus(d: Path) -> Path:
    rng = random.Random(3)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
        "nu",
    ]
    recs = []
    for i in range(400):
        text = " ".join(rng.choice(words) + str(rng.randrange(50)) for _ in range(60))
        recs.append({"id": f"doc{i:04d}", "text": text + f" mail{i}@example.com"})
    for i in range(0, 400, 20):  # exact duplicates
        recs.append({"id": f"copy{i:04d}", "text": recs[i]["text"]})
    recs.append({"id": "short", "text": "tiny"})
    for k in range(4):
        write_jsonl(d / f"in-{k}.jsonl", recs[k::4])
    return d


def _steps(flag: str | None = None) -> list[Step]:
    steps: list[Step] = [CountsFilter(min_words=5), GopherRepetitionFilter(), ExactDedup()]
    if flag:
        steps.append(KillOnce("doc0357", flag))
    steps += [MinHashDedup("fineweb"), PIIRedactor()]
    return steps


def _snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("part-*"))}


def test_killed_worker_then_rerun_gives_identical_output(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "in")
    opts = RunOptions(tasks=6)
    ref = tmp_path / "ref"
    done_flag = tmp_path / "already-killed"
    done_flag.touch()  # the reference run: the same steps, no kill
    run_pipeline(_steps(str(done_flag)), str(src), str(ref), LocalExecutor(2), opts)

    out = tmp_path / "out"
    flag = str(tmp_path / "killed")
    with pytest.raises(RuntimeError, match="run again to resume"):
        run_pipeline(_steps(flag), str(src), str(out), LocalExecutor(2), opts)
    assert os.path.exists(flag)
    assert not list(out.glob("part-*"))  # the final stage never completed
    summary = run_pipeline(_steps(flag), str(src), str(out), LocalExecutor(2), opts)
    assert _snapshot(out) == _snapshot(ref)
    assert summary["docs_out"] == len(b"".join(_snapshot(ref).values()).splitlines())
    dropped = {s["name"]: s["dropped"] for s in summary["steps"]}
    assert dropped["exact_dedup"] == {"exact_duplicate": 20}
    assert dropped["counts"] == {"too_few_words": 1}


def _uneven_corpus(d: Path) -> Path:
    """Four input files of equal size (one task each); the first one's documents but one
    are dropped by `CountsFilter(min_words=5)`, so the intermediate files are uneven."""
    for k in range(4):
        recs = []
        for i in range(50):
            n = 50 * k + i
            if k == 0 and i:  # 4 words: dropped
                text = " ".join(f"d{n:03d}" + "x" * 95 for _ in range(4))
            else:  # 50 words, as long
                text = " ".join(f"k{n:03d}w{j:02d}" for j in range(50))
            assert len(text) == 399
            recs.append({"id": f"d{n:04d}", "text": text})
        write_jsonl(d / f"in-{k}.jsonl", recs)
    return d


@pytest.mark.parametrize("dedup", [False, True])  # one stage; two (intermediate one removed)
def test_rerun_of_a_complete_run_skips_every_task(tmp_path: Path, caplog, dedup: bool) -> None:
    src = _uneven_corpus(tmp_path / "in")
    steps: list[Step] = [CountsFilter(min_words=5), *([ExactDedup()] if dedup else []),
                         PIIRedactor()]
    # default tasking: tasks follow the sizes of the input, or of the intermediate files a
    # finished run has removed (the re-run was refused as "a different pipeline" then)
    first = run_pipeline(steps, str(src), str(tmp_path / "o"), LocalExecutor(1))
    before = _snapshot(tmp_path / "o")
    caplog.set_level("INFO")
    again = run_pipeline(steps, str(src), str(tmp_path / "o"), LocalExecutor(1))
    assert f"stage 1/{1 + dedup}: 4/4 tasks already complete" in caplog.text
    assert caplog.text.count("tasks already complete") == 1 + dedup
    assert "tasks done" not in caplog.text
    assert _snapshot(tmp_path / "o") == before
    assert (tmp_path / "o" / "manifest.json").is_file() and first["docs_out"] == 151
    assert [(s["seen"], s["kept"], s["dropped"]) for s in again["steps"]] == \
        [(s["seen"], s["kept"], s["dropped"]) for s in first["steps"]]
    with pytest.raises(ValueError, match="different pipeline"):
        run_pipeline(
            [CountsFilter(min_words=9)],
            str(src),
            str(tmp_path / "o"),
            LocalExecutor(1),
            RunOptions(tasks=3),
        )


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}},
    )
    yield ray
    ray.shutdown()


def test_ray_executor_matches_local(ray_session, tmp_path: Path) -> None:
    from scaletrain.curate.executors.ray import RayExecutor

    src = _corpus(tmp_path / "in")
    opts = RunOptions(tasks=4)
    run_pipeline(_steps(), str(src), str(tmp_path / "local"), LocalExecutor(2), opts)
    s = run_pipeline(_steps(), str(src), str(tmp_path / "ray"), RayExecutor(), opts)
    assert s["executor"] == "ray"
    assert _snapshot(tmp_path / "ray") == _snapshot(tmp_path / "local")
    assert len(_snapshot(tmp_path / "ray")) == 4
