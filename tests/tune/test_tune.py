"""`scaletrain tune` without processes: the rank correlation, the flag merge, and the rounds
(successive halving, failures, skips, budget, resume) driven by a stand-in for the trials."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from scaletrain.plan.hardware import Device
from scaletrain.plan.layout import Layout
from scaletrain.plan.timing.step_time import Cluster
from scaletrain.tune.candidates import from_search, user_candidate
from scaletrain.tune.flags import merge, parse_flags
from scaletrain.tune.halving import Tuner, TuneSetup
from scaletrain.tune.ranking import spearman
from scaletrain.tune.report import page, summary
from scaletrain.tune.results import correlation
from scaletrain.tune.trial import TrialResult

CPU = Device("test cpu", 8.0, {"fp32": 0.05}, intra_node_gbs=2.0, inter_node_gbs=2.0,
             gpus_per_node=4)
USER = ["--data.seq_len", "64", "--training.micro_batch_size", "2",
        "--precision.dtype", "fp32"]


def test_spearman_on_known_orders_and_ties() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: ranks x = 1, 2.5, 2.5, 4; y = 1, 2, 3, 4
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert spearman([1, 2], [2, 1]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_spearman_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(3, 12)
        x = [rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(n)]
        y = [rng.random() for _ in range(n)]
        ref = stats.spearmanr(x, y).statistic
        ours = spearman(x, y)
        if ours is None:
            assert len(set(x)) == 1
        else:
            assert ours == pytest.approx(ref, abs=1e-12)


def test_flags_merge_replaces_each_flag_once() -> None:
    base = ["--config", "debug", "--data.paths", "a.bin", "b.bin", "--training.steps=5",
            "--output", "runs/x"]
    got = merge(base, ["--training.steps", "7", "--data.paths", "c.bin"])
    flags = parse_flags(got)
    assert flags["--training.steps"] == ["7"]
    assert flags["--data.paths"] == ["c.bin"]
    assert flags["--config"] == ["debug"] and flags["--output"] == ["runs/x"]
    assert got.count("--training.steps") == 1


def _specs(world: int = 2):
    base = Layout(seq_len=64, gbs=4, mbs=2, precision="fp32")
    from scaletrain.models.args import get_preset

    return from_search(get_preset("debug").replace(vocab_size=8192), Cluster(CPU, world, world),
                       "debug", base)


def test_search_candidates_become_trials_in_the_search_order() -> None:
    specs = _specs()
    assert specs and len({s.id for s in specs}) == len(specs)
    times = [s.predicted_step_s for s in specs]
    assert times[0] <= min(times) * 1.006
    assert {"--training.fused_loss"} <= set(parse_flags(specs[0].flags))
    assert any("fused loss on" in s.variant for s in specs)
    assert any("fused loss off" in s.variant for s in specs)


class FakeRuns:
    """Stands in for the torchrun trials: a step time per layout and variant index."""

    def __init__(self, times: dict[str, float], fail: set[str] = frozenset(), wall: float = 1.0):
        self.times, self.fail, self.wall, self.ran = times, fail, wall, []

    def __call__(self, spec, out: Path, deadline: float, best: float | None) -> TrialResult:
        self.ran.append(spec.id)
        if spec.layout in self.fail:
            return TrialResult("oom", message="out of memory (stand-in)", wall_s=self.wall)
        t = self.times.get(spec.layout, 1.0) * (1 + 0.01 * self.ran.count(spec.id)) \
            * (0.9 if "fused loss on" in spec.variant else 1.0)
        if best is not None and t > 1.25 * best:
            return TrialResult("stopped", step_time_s=t, wall_s=self.wall)
        return TrialResult("ok", step_time_s=t, wall_s=self.wall)


def _setup(tmp_path: Path, **kw) -> TuneSetup:
    return TuneSetup(USER, tmp_path / "tune", 2, torch.device("cpu"), 8 * 2**30,
                     kw.pop("budget_s", 600.0), header={"user_argv": USER, "world_size": 2},
                     **kw)


def test_successive_halving_keeps_the_faster_layouts_and_survives_failures(
        tmp_path: Path) -> None:
    specs = _specs()
    layouts = list(dict.fromkeys(s.layout for s in specs))
    assert len(layouts) >= 3
    fast, slow, broken = layouts[1], layouts[0], layouts[2]
    runs = FakeRuns({fast: 0.5, slow: 0.6}, fail={broken})
    users = [user_candidate(["--training.micro_batch_size", "4096"])]  # does not fit
    tuner = Tuner(_setup(tmp_path, layouts=3, variants=3), specs, run=runs)
    tuner.run_user(users)
    tuner.run()
    by_layout = {}
    for t in tuner.trials:
        by_layout.setdefault(t.spec.layout, []).append(t.result.status)
    assert by_layout["as given"] == ["skipped"]
    assert "does not fit" in tuner.trials[0].spec.skip_reason
    assert by_layout[broken] == ["oom"]  # reported, and the rounds went on
    assert by_layout[fast].count("ok") >= 2  # the faster layout was tuned inside
    assert len(by_layout[slow]) < len(by_layout[fast])  # the slower one was halved away
    win = tuner.winner()
    assert win is not None and win.spec.layout == fast
    assert win.result.step_time_s == min(t.result.step_time_s for t in tuner.trials
                                         if t.result.status == "ok")
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert saved["winner"] == win.spec.id
    assert [t["id"] for t in saved["trials"]] == [t.spec.id for t in tuner.trials]
    c = correlation(tuner.trials)
    timed = [t for t in tuner.trials if t.result.status in ("ok", "stopped")]
    assert c["pairs"] == len(timed) >= 3
    assert c["search_order"] == [t.spec.id for t in sorted(timed, key=lambda t:
                                                           t.spec.search_rank)]
    assert c["measured_order"] == [t.spec.id for t in sorted(timed, key=lambda t:
                                                             t.result.step_time_s)]
    text = summary(tuner, None)
    assert "oom:" in text and "skipped:" in text and "winner:" in text
    assert "<svg" in page(tuner, text)
    stats = pytest.importorskip("scipy.stats")
    ref = stats.spearmanr([t.spec.search_rank for t in timed],
                          [t.result.step_time_s for t in timed]).statistic
    assert c["spearman"] == pytest.approx(ref)


def test_resume_runs_no_finished_trial_again(tmp_path: Path) -> None:
    specs = _specs()
    layouts = list(dict.fromkeys(s.layout for s in specs))
    first = FakeRuns({layouts[0]: 0.5})
    Tuner(_setup(tmp_path, layouts=2, variants=2), specs, run=first).run()
    again = FakeRuns({layouts[0]: 0.5})
    tuner = Tuner(_setup(tmp_path, layouts=2, variants=2, resume=True), _specs(), run=again)
    tuner.run()
    assert again.ran == []
    assert [t.spec.id for t in tuner.trials] == first.ran
    assert all(t.reused for t in tuner.trials)
    other = _setup(tmp_path, resume=True)
    other.user_argv = [*USER, "--training.steps", "3"]
    from scaletrain.tune.halving import TuneError

    with pytest.raises(TuneError, match="other settings"):
        Tuner(other, specs)


def test_the_budget_stops_the_rounds(tmp_path: Path) -> None:
    specs = _specs()
    runs = FakeRuns({}, wall=1000.0)  # every trial "took" longer than the whole budget
    tuner = Tuner(_setup(tmp_path, layouts=4, budget_s=60.0), specs, run=runs)
    tuner.run()
    assert len(runs.ran) == 1
    assert tuner.not_run
    assert correlation(tuner.trials)["pairs"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2"], "runs its trials on this node only"),
    (["--budget-minutes", "0"], "--budget-minutes must be positive"),
    (["--stop-ratio", "0.5"], "--stop-ratio must be above 1"),
    (["--budget-minute", "3"], "unknown option --budget-minute"),
])
def test_user_mistakes_are_one_line_and_exit_2(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture) -> None:
    from scaletrain.cli import main

    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_trial_is_killed_at_the_deadline(tmp_path: Path) -> None:
    import time

    from scaletrain.tune.trial import run_trial

    start = time.monotonic()
    r = run_trial(USER, tmp_path / "t", 1, 1, deadline=start + 1.0, best_step_s=None,
                  stop_ratio=1.25, peak_tflops=None)
    assert r.status == "budget" and "time budget" in r.message
    assert time.monotonic() - start < 15  # killed, not waited for (torchrun's own exit aside)
    assert (tmp_path / "t" / "command.txt").read_text().split()[1:4] == [
        "-m", "torch.distributed.run", "--standalone"]


def test_a_trial_stops_only_when_its_fastest_warm_step_cannot_win() -> None:
    from scaletrain.tune.trial import _too_slow

    rows = [{"step": 1, "step_time_s": 9.0}, {"step": 2, "step_time_s": 3.0}]
    assert _too_slow(rows, 2, best_step_s=1.0, stop_ratio=1.25) is None  # one warm step only
    rows.append({"step": 3, "step_time_s": 1.2})
    assert _too_slow(rows, 2, best_step_s=1.0, stop_ratio=1.25) is None  # 1.2 could still win
    rows[2]["step_time_s"] = 1.3
    stopped = _too_slow(rows, 2, best_step_s=1.0, stop_ratio=1.25)
    assert stopped is not None and stopped.status == "stopped" and stopped.step_time_s == 1.3
