"""Experiment trackers: TensorBoard, Weights & Biases and MLflow behind one small interface.

`metrics.loggers = ["tensorboard", "wandb", "mlflow"]` opens one `Tracker` each; the trainer
sends every step's metrics, the plan and (after a profiled window) the verdict to all of them.
The HF Trainer and Lightning callbacks (`scaletrain.integrations`) use the same classes around
the runs those frameworks opened.

Both W&B and MLflow run offline: W&B with `WANDB_MODE=offline` (files under
`<output>/wandb`, `wandb sync` uploads them later); MLflow to a local store, by default
`<output>/mlruns` (MLflow's file store), or `metrics.mlflow_tracking_uri`/`MLFLOW_TRACKING_URI`.
Each library is imported only when its tracker opens.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from scaletrain.config_sections import METRICS_LOGGERS as LOGGERS

log = logging.getLogger(__name__)

_EXTRA = {"tensorboard": "tb", "wandb": "integrations", "mlflow": "integrations"}


class TrackerUnavailable(RuntimeError):
    """The tracker's library is not installed."""


class Tracker(Protocol):
    name: str

    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def text(self, key: str, text: str, step: int) -> None: ...

    def params(self, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, writer: Any, own: bool = True) -> None:
        self.writer, self.own = writer, own

    @classmethod
    def open(cls, logdir: Path) -> TensorBoardTracker:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackerUnavailable(str(e)) from e
        return cls(SummaryWriter(str(logdir)))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def text(self, key: str, text: str, step: int) -> None:
        # Markdown: keep the report's line breaks and columns
        self.writer.add_text(key, "    " + text.replace("\n", "\n    "), step)

    def params(self, values: dict[str, Any]) -> None:
        self.text("config", "\n".join(f"{k} = {v}" for k, v in _flat(values).items()), 0)

    def close(self) -> None:
        if self.own:
            self.writer.close()
        else:
            self.writer.flush()


class WandbTracker:
    name = "wandb"

    def __init__(self, run: Any, own: bool = True, step_key: str = "trainer/step") -> None:
        self.run, self.own, self.step_key = run, own, step_key

    @classmethod
    def open(cls, output: Path, project: str, name: str | None,
             config: dict[str, Any] | None) -> WandbTracker:
        try:
            import wandb
        except ImportError as e:
            raise TrackerUnavailable(str(e)) from e
        output.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=project, name=name, dir=str(output), config=config,
                         reinit="create_new")
        return cls(run)

    def scalars(self, values: dict[str, float], step: int) -> None:
        # No `step=`: a run a framework opened keeps its own step counter; ours is a metric
        self.run.log({**values, self.step_key: step})

    def text(self, key: str, text: str, step: int) -> None:
        self.run.summary[key] = text

    def params(self, values: dict[str, Any]) -> None:
        self.run.config.update(_flat(values), allow_val_change=True)

    def close(self) -> None:
        if self.own:
            self.run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, client: Any, run_id: str, own: bool = True) -> None:
        self.client, self.run_id, self.own = client, run_id, own

    @staticmethod
    def default_uri(output: Path) -> str:
        """`MLFLOW_TRACKING_URI` when set, else a file store in the run directory. MLflow 3
        keeps its file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE
        is set: it is set here for this local default only."""
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (output / "mlruns").resolve().as_uri()

    @classmethod
    def open(cls, uri: str, experiment: str, name: str | None) -> MlflowTracker:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise TrackerUnavailable(str(e)) from e
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else client.create_experiment(experiment)
        run = client.create_run(exp_id, run_name=name)
        return cls(client, run.info.run_id)

    @classmethod
    def active(cls) -> MlflowTracker | None:
        """The run `mlflow.start_run()` (or HF's MLflowCallback) opened, if any."""
        try:
            import mlflow
        except ImportError:
            return None
        run = mlflow.active_run()
        return None if run is None else cls(mlflow.tracking.MlflowClient(), run.info.run_id,
                                            own=False)

    def scalars(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def text(self, key: str, text: str, step: int) -> None:
        first = text.splitlines()[0] if text else ""
        self.client.set_tag(self.run_id, _mlflow_key(key), first[:5000])
        self.client.log_text(self.run_id, text, f"{_mlflow_key(key)}.txt")

    def params(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in _flat(values).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def close(self) -> None:
        if self.own:
            self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow keys allow letters, digits, `_ - . / space`; others become `_`."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def open_trackers(names: tuple[str, ...] | list[str], output: Path, *, run_name: str | None,
                  config: dict[str, Any] | None = None, wandb_project: str = "scaletrain",
                  mlflow_uri: str | None = None, mlflow_experiment: str = "scaletrain",
                  ) -> list[Tracker]:
    """One tracker per name; a library that is not installed is reported and skipped (the run
    goes on with the others and metrics.jsonl)."""
    out: list[Tracker] = []
    for name in dict.fromkeys(names):
        try:
            if name == "tensorboard":
                out.append(TensorBoardTracker.open(output / "tb"))
            elif name == "wandb":
                out.append(WandbTracker.open(output, wandb_project, run_name, config))
            elif name == "mlflow":
                out.append(MlflowTracker.open(mlflow_uri or MlflowTracker.default_uri(output),
                                              mlflow_experiment, run_name))
            else:
                raise ValueError(f"metrics.loggers: unknown logger '{name}' (choose from "
                                 f"{', '.join(LOGGERS)})")
        except TrackerUnavailable:
            log.warning("metrics.loggers: %s is not installed (pip install 'scaletrain[%s]'); "
                        "not logging to it", name, _EXTRA[name])
            continue
        if config and name != "wandb":  # W&B took the config at init
            out[-1].params(config)
    return out
