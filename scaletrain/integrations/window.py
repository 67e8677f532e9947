"""What both framework callbacks share: a profiled window of steps (a `ProfileSession`), the
plan before the first step, and the reports sent to the run's trackers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, TextIO

from scaletrain.integrations.plan import plan_text
from scaletrain.profiling import report
from scaletrain.profiling.session import ProfileSession, stream
from scaletrain.profiling.summary import headline, scalars
from scaletrain.train.run_reports import plan_scalars
from scaletrain.train.trackers import Tracker

log = logging.getLogger(__name__)


class Window:
    """The options both callbacks take, and the session they drive.

    `start_step`: the training step after which the window opens (its `wait` steps start
    counting then); `wait`/`warmup`/`active`: torch.profiler's schedule; `output`: the profile
    folder (default: `<the run's output>/profile`); `plan`: print the plan of the model before
    the first step; `seq_len`: the sequence length the plan assumes (default: the model's
    `max_position_embeddings`); `report`: where the plan and the verdict are printed (None:
    nowhere; the trackers get them either way)."""

    def __init__(self, output: str | Path | None = None, *, start_step: int = 0,
                 wait: int = 1, warmup: int = 1, active: int = 3, plan: bool = False,
                 seq_len: int | None = None, memory_timeline: bool = False,
                 with_stack: bool = False, report: TextIO | str | None = "stdout") -> None:
        if start_step < 0:
            raise ValueError(f"ScaletrainCallback: start_step must not be negative "
                             f"(got {start_step})")
        self.output = None if output is None else Path(output)
        self.start_step = start_step
        self.options = dict(wait=wait, warmup=warmup, active=active,
                            memory_timeline=memory_timeline, with_stack=with_stack)
        self.plan, self.seq_len, self.report = plan, seq_len, report
        self.session: ProfileSession | None = None
        self.result: dict[str, Any] | None = None
        self.plan_json: dict[str, Any] | None = None
        self._steps = 0
        self._default = Path(".")
        ProfileSession(".", report=None, **self.options)  # checks the schedule now

    # --- plan --------------------------------------------------------------------------------
    def print_plan(self, config: Any, trackers: list[Tracker], step: int, **layout: Any) -> None:
        if config is None:
            text, self.plan_json = "scaletrain plan: the model has no Hugging Face config", None
        else:
            if layout.get("seq_len") is None:
                layout["seq_len"] = self.seq_len or _max_positions(config)
            text, self.plan_json = plan_text(config, **layout)
        out = stream(self.report)
        if out is not None:
            print(text, file=out)
        for t in trackers:
            t.text("plan", text, step)
            if self.plan_json:
                t.scalars(plan_scalars(self.plan_json), step)

    # --- the window --------------------------------------------------------------------------
    def begin(self, default_output: Path) -> None:
        """Before the first step; `default_output`: the run's output folder."""
        self._default = default_output
        self._steps = 0
        self._open_if_due()

    def _open_if_due(self) -> None:
        if self.session is None and self._steps >= self.start_step:
            self.session = ProfileSession(self.output or self._default / "profile",
                                          report=self.report, **self.options).start()

    def on_step(self) -> bool:
        """After each optimizer step; True once, when the window's diagnosis is ready."""
        self._steps += 1
        if self.session is None:
            self._open_if_due()
            return False
        if self.session.done or self.result is not None:
            return False
        self.session.step()
        if self.session.done:
            self.result = self.session.result
            return self.result is not None
        return False

    def finish(self) -> bool:
        """At the end of training: close a window the run did not finish (its diagnosis when
        a trace was written). True when a diagnosis became ready now."""
        if self.session is None or self.session.done or not self.session.active:
            return False
        self.session.stop()
        self.result = self.session.result
        return self.result is not None

    def send(self, trackers: list[Tracker], step: int) -> dict[str, float]:
        """The verdict (text), the report (text) and the breakdown (scalars) to each tracker;
        the scalars are returned for the framework's own records."""
        assert self.result is not None
        values = scalars(self.result)
        text = report.terminal(self.result)
        for t in trackers:
            try:
                t.text("profile/verdict", self.result["verdict"], step)
                t.text("profile/report", text, step)
                t.scalars(values, step)
            except Exception as e:  # a tracker's failure must not stop training
                log.warning("scaletrain: logging the diagnosis to %s failed: %s", t.name, e)
        log.info("scaletrain: %s", headline(self.result))
        return values


def _max_positions(config: Any) -> int:
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    return int(get("max_position_embeddings", None) or get("n_positions", None) or 2048)
