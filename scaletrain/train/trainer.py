"""The training loop: the only place where model, techniques, data and optimizer meet."""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from scaletrain.config import Config, ConfigError, resolve_batch, to_toml
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import Transformer, build_model
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.fp8 import apply_fp8, fp8_problem
from scaletrain.parallel.parallelize import Parallelism
from scaletrain.plan.flops import flops_per_token
from scaletrain.plan.hardware import device_name, peak_tflops
from scaletrain.profiling.capture import StepProfiler, phase
from scaletrain.runtime import resolve_device
from scaletrain.train import precision, rng
from scaletrain.train.checkpoint import Checkpointer, CheckpointError
from scaletrain.train.evaluate import evaluate
from scaletrain.train.host_allocator import (
    apply_mmap_threshold,
    glibc,
    malloc_trim,
    trim_after_forward,
)
from scaletrain.train.loss import cross_entropy_sum
from scaletrain.train.lr_schedule import LRSchedule
from scaletrain.train.metrics import MemoryBaseline, MetricsLogger, step_metrics
from scaletrain.train.moe_metrics import collect_moe_stats
from scaletrain.train.optim import build_optimizer
from scaletrain.train.run_reports import diagnose_window, log_plan, run_trackers
from scaletrain.train.step import StepOutput, TrainStep

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite and `training.on_nan` is `stop`."""


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    checkpoint: Path | None = None
    sample: str | None = None
    wall_time_s: float = 0.0
    tokens_seen: int = 0
    """Tokens of the training batches the run has consumed in all, earlier runs it resumed
    included (samples x sequence length; padding of fine-tuning rows included)."""


def fused_loss_problem(model: Any, custom_forward: bool) -> str | None:
    """Why `training.fused_loss` cannot run with this model (None when it can). Every parallel
    layout runs it: vocabulary-parallel under TP, on the last stage under PP."""
    if custom_forward or not isinstance(model, Transformer):
        return ("training.fused_loss needs the plain decoder's language-model head "
                "(pre-training, fine-tuning --task sft); set training.fused_loss false")
    return None


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


class Trainer:
    """Builds everything a run needs from a validated `Config`, then `train()` runs it."""

    checkpointer_cls: type[Checkpointer] = Checkpointer

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.training.device)
        if self.device.type == "cpu":  # before any tensor of the run is allocated
            log.info("memory: %s", apply_mmap_threshold(cfg.training.cpu_mmap_threshold_mb))
        # Degrees from the config and torchrun's world size; checked before any collective.
        self.par = Parallelism(cfg.parallel, self.device, fp8=cfg.precision.fp8,
                               param_dtype=cfg.precision.param_dtype)
        self.is_main = self.par.is_main
        self.diagnosis: dict[str, Any] | None = None  # of the profiled window (profiling.enabled)
        seed_everything(cfg.training.seed, cfg.training.deterministic)
        self.output = Path(cfg.output)
        self.output.mkdir(parents=True, exist_ok=True)
        self.dtype = precision.resolve_dtype(cfg.precision, self.device)
        if cfg.precision.param_dtype == "bf16" and self.dtype == "fp16":
            raise ConfigError("precision.param_dtype bf16 cannot be combined with fp16 autocast; "
                              "use precision.dtype bf16")
        if cfg.optimizer.offload and self.dtype == "fp16":
            raise ConfigError("optimizer.offload does not support fp16 loss scaling; "
                              "use precision.dtype bf16 or fp32")
        fp8 = fp8_problem(cfg.precision.fp8, self.device, self.dtype)
        if fp8:
            raise ConfigError(fp8)
        self.ga = resolve_batch(cfg.training, self.par.dims.dp)[1]  # GBS = MBS x GA x DP
        self.mbs = cfg.training.micro_batch_size
        if self.par.enabled:
            self._check_distributed()
        # This rank's place among the data-parallel ranks (the parallelism layer sets them).
        self.dp_rank, self.dp_size = self.par.dp_rank, self.par.dp_size
        self.global_batch = self.mbs * self.ga * self.dp_size
        # The checkpoint to continue from, checked against this run's settings before any
        # data or model is built (`train/resume.py`).
        self.resume_from, self.resume_settings = self._find_resume()
        self._build_data()
        # CPU: the heap's free pages go back before the baseline (what preparing the data freed
        # would otherwise hide training's own pages) and after each forward pass
        trim_heap = (self.device.type == "cpu" and cfg.training.cpu_malloc_trim
                     and glibc() is not None)
        if trim_heap:
            malloc_trim()
        self.mem_baseline = MemoryBaseline(self.device)  # peaks are reported above it
        self.model_args = self._model_args()
        self.model = self._build_model()  # initialized from training.seed, as in one process
        if trim_heap:  # pipeline stages run their own forward, not the model's
            for module in [self.model, *self.par.stage_modules]:
                trim_after_forward(module)
        # Then each rank's own training stream (dropout): see `train/rng.py`.
        self.rng_stream = rng.rng_stream(self.dp_rank, self.par.cp_rank, self.par.dims.cp,
                                         self.par.pp_rank, self.dp_size)
        rng.seed_training_rng(cfg.training.seed, self.rng_stream)
        self.optimizer = self._build_optimizer()
        self.loss_fn = cross_entropy_sum
        if cfg.compile.enabled and not self.par.enabled:
            self.loss_fn = torch.compile(cross_entropy_sum)
        step_loss, step_forward = (lambda logits, y: self.loss_fn(logits, y)), self.model_forward
        if cfg.training.fused_loss:
            step_loss, step_forward = self._fused_loss()
        # Validation takes the training step's loss path: with the fused loss it never builds
        # the (tokens x vocabulary) logits either, so it fits where the training step does.
        self.eval_loss, self.eval_forward = ((step_loss, step_forward) if cfg.training.fused_loss
                                             else (cross_entropy_sum, self.model_forward))
        if self.par.dims.pp > 1:
            self.par.attach_pipeline(self.model, step_loss,
                                     cfg.parallel.pp_microbatches or self.ga,
                                     lambda: precision.autocast(self.device, self.dtype),
                                     hidden=cfg.training.fused_loss)
        if self.par.master_weights and not self.par.enabled:  # one process: bf16 weights
            # (with several processes the partitioned optimizer casts them, and FSDP keeps fp32
            # shards and computes in bf16 itself); buffers (RoPE frequencies) stay fp32
            precision.cast_params_(list(self.model.parameters()), torch.bfloat16)
        self.schedule = LRSchedule(self.optimizer, cfg.lr_schedule, cfg.optimizer.lr,
                                   cfg.training.steps)
        self.scaler = precision.grad_scaler(
            self.device, self.dtype, sharded=self.par.enabled and not self.par.ddp_wrapped)
        self.has_moe = self.model_args.is_moe
        self.step_fn = TrainStep(self.model, self.optimizer, self.par, self.device, self.dtype,
                                 step_loss, cfg.training.max_grad_norm, self.scaler, step_forward)
        self.checkpointer = self.checkpointer_cls(self.output / "checkpoints",
                                                  cfg.checkpoint.keep_last, self.model_args,
                                                  self.corpus.tokenizer_path,
                                                  verify=cfg.checkpoint.verify,
                                                  async_save=cfg.checkpoint.async_save)
        self.step = 0
        if self.resume_from is not None:
            self._resume()
        if self.is_main:  # only now: a resume that fails leaves the run directory as it was
            (self.output / "config.toml").write_text(to_toml(cfg))
        self.flops_per_token = flops_per_token(self.model_args, cfg.data.seq_len)
        # fp8: MFU stays against the bf16 peak; the fp8 peak's share is reported alongside.
        fp8 = cfg.precision.fp8 != "none"
        mfu_dtype = "bf16" if fp8 else self.dtype
        peak = peak_tflops(device_name(self.device), mfu_dtype)
        self.peak_flops = None if peak is None else peak * 1e12
        peak8 = peak_tflops(device_name(self.device), "fp8") if fp8 else None
        self.peak_flops_fp8 = None if peak8 is None else peak8 * 1e12
        if self.peak_flops is None:
            log.warning("MFU: no peak-FLOPS entry for device '%s' in %s; mfu is reported as null",
                        device_name(self.device), mfu_dtype)

    # --- construction -----------------------------------------------------------------------
    def _check_distributed(self) -> None:
        """Layout problems as one message, then the process group and the mesh."""
        if self.cfg.optimizer.offload:
            raise ConfigError("optimizer.offload is a single-process option; with several "
                              "processes use parallel.cpu_offload (zero2/zero3)")
        self.par.validate(self.resolved_model_args, self.cfg.data.seq_len, self.ga)
        self.par.start()
        self.is_main = self.par.is_main

    def _build_optimizer(self) -> Any:
        cfg = self.cfg
        par = self.par
        masters = par.enabled and par.master_weights  # 16-bit parameters, several processes
        if par.enabled and (par.mode == "zero1" or masters):
            from scaletrain.train.zero1 import PartitionedOptimizer

            # ZeRO-1 partitions state (and fp32 masters) over the data-parallel ranks; 16-bit
            # parameters in other layouts without FSDP keep whole masters on every rank.
            return PartitionedOptimizer(self.model, cfg.optimizer, self.device,
                                        par.mesh.group("dp_cp"), cfg.parallel.bucket_cap_mb,
                                        masters=masters, shard=par.mode == "zero1")
        param_dtype = cfg.precision.param_dtype if par.master_weights else "fp32"
        return build_optimizer(self.model, cfg.optimizer, self.device, param_dtype)

    def _build_data(self) -> None:
        from scaletrain.data.loader import build_train_val

        pin = self.cfg.data.pin_memory
        if pin is None:
            pin = self.device.type == "cuda"
        self.pin_memory = pin
        # The samples the whole run consumes (GBS x steps, or those a resumed run consumed plus
        # its remaining steps' batches); the order of the first ones does not depend on it, so
        # a resumed run with more steps or another batch continues the same order.
        num_samples = self.cfg.training.steps * self.global_batch
        if self.resume_settings is not None:
            done = self.resume_settings["consumed_samples"]
            num_samples = done + max(self.cfg.training.steps - self.resume_step, 0) \
                * self.global_batch
        self.train_stream, self.val_data, self.corpus = build_train_val(
            self.cfg.data, self.mbs, self.cfg.training.seed, pin_memory=pin,
            dp_rank=self.dp_rank, dp_size=self.dp_size, num_samples=num_samples,
            grad_accum=self.ga,
        )

    @functools.cached_property
    def resolved_model_args(self) -> ModelArgs:
        """The model the config describes (`data.sources.resolve_model_args`: the tokenizer
        may widen the vocabulary), resolved once."""
        from scaletrain.data.sources import resolve_model_args

        return resolve_model_args(self.cfg)

    def _model_args(self) -> ModelArgs:
        args = self.resolved_model_args
        if self.corpus.vocab_size > args.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.corpus.vocab_size} tokens but model.vocab_size is "
                f"{args.vocab_size}; drop --model.vocab_size (the model then widens to the "
                "tokenizer's) or give at least that many"
            )
        return args

    def _build_model(self) -> Transformer:
        if self.par.enabled:
            model = self.par.build_model(self.model_args, self.cfg.training.seed,
                                         self.cfg.activation_checkpoint, self.cfg.compile)
            model.train()
            return model
        model = build_model(self.model_args, self.device, seed=self.cfg.training.seed)
        n = sum(p.numel() for p in model.parameters())
        log.info("model %s: %s parameters, %s on %s", self.cfg.model.name, f"{n:,}",
                 self.dtype, self.device)
        apply_fp8(model, self.cfg.precision.fp8, self.device)
        apply_ac(model, self.cfg.activation_checkpoint)
        apply_compile(model, self.cfg.compile)
        model.train()
        return model

    # --- state ------------------------------------------------------------------------------
    @property
    def rng_layout(self) -> torch.Tensor:
        """World size, mesh shape and this rank's RNG stream: a saved RNG state is restored
        only into the same (`train/rng.py`)."""
        return rng.layout_tensor(self.par.dims.world_size,
                                 tuple(self.par.dims.mesh_shape.values()), self.rng_stream)

    def _extra_state(self) -> dict[str, Any]:
        """Everything besides model and optimizer a checkpoint holds; this rank's RNG state
        under its own key (DCP keeps one copy of entries that share a key)."""
        extra: dict[str, Any] = {
            "lr_schedule": self.schedule.state_dict(),
            "data": self.train_stream.state_dict(),
            "rng": {rng.rank_key(self.par.rank): {**rng.rng_state(self.device),
                                                  "layout": self.rng_layout}},
        }
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        return extra

    def _find_resume(self) -> tuple[Path | None, dict[str, Any] | None]:
        """(checkpoint to continue from, the settings it was trained with) per
        `checkpoint.resume`; a setting that would silently change the run is refused here."""
        mode = self.cfg.checkpoint.resume
        folder = self.output / "checkpoints"
        self.resume_step = 0
        steps = Checkpointer.steps_in(folder)
        if mode is False:
            if steps and (self.cfg.checkpoint.save_final or self.cfg.checkpoint.interval
                          or self.cfg.checkpoint.interval_minutes):
                log.warning("checkpoint.resume is false: starting fresh although %s holds "
                            "checkpoints (later saves replace them)", folder)
            return None, None
        if not steps:
            if mode is True:
                raise CheckpointError(
                    f"checkpoint.resume is true but no complete checkpoint exists under {folder};"
                    " run without --checkpoint.resume true to start fresh")
            return None, None
        self.resume_step = steps[-1]
        path = folder / Checkpointer.dir_name(steps[-1])
        return path, self._checked_settings(path, steps[-1])

    def _checked_settings(self, path: Path, step: int) -> dict[str, Any] | None:
        """The `run.json` of checkpoint `path` (at `step`), checked against this run."""
        from scaletrain.train.resume import check_resume, read_run_settings

        settings = read_run_settings(path)
        if settings is None:
            log.warning("%s has no run.json (an older scaletrain): its schedule, batch and data "
                        "settings cannot be checked against this run's", path)
        else:
            check_resume(settings, self.cfg, self.global_batch, step, path)
        return settings

    def _resume(self) -> None:
        """Load `resume_from`; with `checkpoint.resume auto` a damaged newest checkpoint gives
        way to the one before it (each checked as the first was)."""
        candidates = [s for s in reversed(self.checkpointer.steps()) if s <= self.resume_step]
        for i, step in enumerate(candidates):
            path = self.checkpointer.path(step)
            if i:
                self._checked_settings(path, step)
            try:
                self._load_checkpoint(path)
                return
            except CheckpointError as e:
                if self.cfg.checkpoint.resume != "auto" or i + 1 == len(candidates):
                    raise
                log.warning("%s; resuming from the checkpoint before it", e)

    def _load_checkpoint(self, path: Path) -> None:
        from scaletrain.checkpoint.safe_dcp import read_metadata

        template = self._extra_state()
        rank = self.par.rank
        try:  # a damaged checkpoint is reported by `load` below
            stored = set(read_metadata(path).state_dict_metadata)
        except CheckpointError:
            stored = set()
        template["rng"] = rng.saved_template(rank, self.rng_layout, stored, self.device)
        extra = self.checkpointer.load(path, self.model, self.optimizer, template)
        self.schedule.load_state_dict(extra["lr_schedule"])
        self.train_stream.load_state_dict(extra["data"])
        exact = all(self.par.gather_objects(rng.is_exact(extra["rng"], rank, self.rng_layout)))
        rng.restore(extra["rng"], rank, self.rng_layout, exact, self.cfg.training.seed,
                    self.rng_stream, int(extra["step"]), self.device)
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        self.step = int(extra["step"])

    def save_checkpoint(self) -> Path:
        from scaletrain.train.resume import run_settings

        consumed = self.train_stream.state_dict()["consumed_samples"]
        run = run_settings(self.cfg, self.global_batch, consumed)
        # Rank 0 renames and prunes while the others wait: the start-up timeout holds.
        self.collective_timeout(self.cfg.parallel.timeout_s)
        try:
            return self.checkpointer.save(self.step, self.model, self.optimizer,
                                          self._extra_state(), run)
        finally:
            if self.step > 0:
                self.collective_timeout(self.cfg.parallel.step_timeout_s)

    def collective_timeout(self, seconds: float) -> None:
        """Bound the run's collectives by `seconds` (not those of a background checkpoint
        write, which keep the start-up timeout)."""
        from scaletrain.parallel.mesh import set_collective_timeout

        group = self.checkpointer.async_group
        set_collective_timeout(seconds, skip=() if group is None else (group,))

    # --- one step ---------------------------------------------------------------------------
    def next_batches(self) -> list[Batch]:
        """The micro-batches of one optimizer step, on the device."""
        out = []
        for _ in range(self.ga):
            with phase("data"):
                x, y = next(self.train_stream)
            out.append((x.to(self.device, non_blocking=self.pin_memory),
                        y.to(self.device, non_blocking=self.pin_memory)))
        return out

    def run_step(self, batches: list[Batch]) -> StepOutput:
        """One optimizer step over the micro-batches (every layout); device tensors back."""
        out = self.step_fn(batches)
        self.schedule.step()
        return out

    def train_step(self, batches: list[Batch]) -> tuple[float, float]:
        """`run_step`, read back at once: (loss, grad_norm) as floats, and `training.on_nan`
        applied (for tests and benchmarks; the loop reads values at log steps only)."""
        out = self.run_step(batches)
        loss, norm, skipped = torch.stack([out.loss.float(), out.grad_norm.float(),
                                           out.skipped.float()]).tolist()
        if skipped:
            self._on_nonfinite(loss, self.step + 1)
            return loss, float("nan")
        return loss, norm

    def _fused_loss(self) -> tuple[Any, Any]:
        """(loss, forward) of the training step with `training.fused_loss`: the forward gives
        the final-norm hidden states (through the model's own forward, so DDP's and FSDP's
        hooks run; under PP the last stage's), the loss applies the head chunk by chunk:
        vocabulary-parallel when the head is sharded over the tensor-parallel ranks (a
        DTensor)."""
        from scaletrain.train.chunked_loss import chunked_linear_cross_entropy
        from scaletrain.train.chunked_loss_tp import vocab_parallel_linear_cross_entropy

        problem = fused_loss_problem(self.core,
                                     type(self).model_forward is not Trainer.model_forward
                                     and type(self).hidden_forward is Trainer.hidden_forward)
        if problem:
            raise ConfigError(problem)
        chunk, cap = self.cfg.training.loss_chunk_tokens, self.model_args.final_softcap
        if chunk < 1:
            raise ConfigError(f"training.loss_chunk_tokens must be >= 1, got {chunk}")
        core = self.core

        def loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            w = core.output.weight  # read now: FSDP swaps in the gathered weight in forward
            if isinstance(w, DTensor):
                return vocab_parallel_linear_cross_entropy(h, w, y, chunk, cap)
            return chunked_linear_cross_entropy(h, w, y, chunk, cap)

        return loss, self.hidden_forward

    def hidden_forward(self, x: Any, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states of one micro-batch's inputs: `model_forward` without
        the head (`training.fused_loss`); a trainer that overrides `model_forward` overrides
        this too, or the fused loss is refused."""
        return self.model(x, positions=positions, hidden=True)

    @property
    def core(self) -> Any:
        """The model without its DDP wrapper."""
        return getattr(self.model, "module", self.model)

    def model_forward(self, x: Any, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for one micro-batch's inputs (fine-tuning passes inputs beyond token ids;
        `positions`: this rank's token positions under context parallelism)."""
        return self.model(x) if positions is None else self.model(x, positions=positions)

    def _guarded_step(self, batches: list[Batch], heartbeat: Any) -> StepOutput:
        """run_step; with several processes a failed collective becomes one clear error
        naming the rank that stopped (see `parallel.failure.guard`)."""
        from scaletrain.parallel.failure import guard

        with guard(heartbeat, self.step + 1):
            return self.run_step(batches)

    def _on_nonfinite(self, loss: float, step: int) -> None:
        causes = ("learning rate too high (optimizer.lr, lr_schedule.warmup_steps), fp16 overflow "
                  "(use bf16 or keep the loss scaler), a bad batch, or no gradient clipping "
                  "(training.max_grad_norm)")
        if self.cfg.training.on_nan == "stop":
            raise TrainingDiverged(f"loss is {loss} at step {step}; likely causes: {causes}. "
                                   "Set --training.on_nan skip to skip such steps.")
        log.warning("loss is %s at step %d: optimizer step skipped (likely causes: %s)",
                    loss, step, causes)

    # --- evaluation -------------------------------------------------------------------------
    def evaluate_tensor(self) -> torch.Tensor:
        """Validation loss over `training.eval_sequences` sequences, split over the
        data-parallel ranks (a device tensor, equal on every rank)."""
        return evaluate(self.model, self.par, self.val_data, self.cfg.training.eval_sequences,
                        self.mbs, self.device, self.dtype, self.eval_loss,
                        prepare=self.eval_prepare, forward=self.eval_forward,
                        hidden=self.cfg.training.fused_loss)

    def eval_prepare(self, x: Any, y: torch.Tensor) -> Batch:
        return x.to(self.device), y.to(self.device)

    def evaluate(self) -> float:
        """Validation loss; a non-finite one follows `training.on_nan`."""
        loss = float(self.evaluate_tensor())
        if not math.isfinite(loss):
            msg = f"validation loss is {loss} at step {self.step}"
            if self.cfg.training.on_nan == "stop":
                raise TrainingDiverged(msg + "; the weights are not finite or the validation "
                                       "data is bad. Set --training.on_nan skip to continue.")
            log.warning("%s (training.on_nan is skip: continuing)", msg)
        return loss

    # --- the loop ---------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """The loop, the same for every layout. Steps run without reading values back to the
        host; at log steps (the run's first step, every `metrics.log_interval`, before an
        evaluation or checkpoint, and at the end) the pending steps' losses and norms are read
        in one transfer, written to the metrics (each step's own values), and a non-finite step
        acts on `on_nan`.

        After each step every rank agrees whether to stop (a preemption signal: checkpoint,
        then `Preempted`) and whether a timed checkpoint is due (`train/preemption.py`). Once
        the first step has run, collectives are bounded by `parallel.step_timeout_s` and a step
        that outlasts it leaves every rank's stack under `<output>/stacks/`."""
        from scaletrain.train.preemption import Preempted, StepBoundary, clear_marker, write_marker

        cfg = self.cfg
        if self.resume_from is not None and self.step >= cfg.training.steps:
            log.info("the run is complete: %s is at step %d of %d, nothing to train (more steps: "
                     "raise --training.steps; a new run: another --output)", self.resume_from,
                     self.step, cfg.training.steps)
            return TrainResult(steps=self.step, checkpoint=self.resume_from,
                               tokens_seen=self._tokens_seen())
        start = time.perf_counter()
        result = TrainResult(steps=self.step)
        first = self.step + 1  # logged alone: the run shows life, warm-up stays out of the means
        heartbeat = self.par.heartbeat()
        boundary = StepBoundary(cfg.checkpoint.signals, cfg.checkpoint.interval_minutes,
                                self.par.enabled, self.is_main)
        boundary.install()
        stop, _ = boundary.decide()  # a signal during start-up: stop before the first step
        if stop is not None:
            boundary.uninstall()
            self.checkpointer.close()
            if heartbeat is not None:
                heartbeat.stop()
            if self.is_main:
                write_marker(self.output, stop, self.step, self.resume_from)
            raise Preempted(stop, self.step, self.resume_from, during_startup=True)
        stacks = self._stack_dumps()
        metrics: Any = _NoMetrics()
        if self.is_main:  # one rank writes metrics, logs and the progress bar
            clear_marker(self.output)
            metrics = MetricsLogger(self.output, cfg.training.steps, cfg.metrics.log_interval,
                                    run_trackers(cfg, self.output), cfg.metrics.progress_bar,
                                    start_step=self.step)
            log_plan(metrics, cfg, self.device, self.step)
        pending = _Pending(time.perf_counter())
        prof = StepProfiler(cfg.profiling, self.output, self.device, start_step=self.step).start()
        try:
            while self.step < cfg.training.steps:
                self._where(heartbeat, "training step")
                if stacks is not None and self.step >= first:
                    stacks.arm(0.9 * cfg.parallel.step_timeout_s)
                t0 = time.perf_counter()
                batches = self.next_batches()
                data_wait = time.perf_counter() - t0
                with prof.oom_guard(cfg):
                    out = self._guarded_step(batches, heartbeat)
                self.step += 1
                if self.step == first and self.par.enabled:  # start-up is over
                    self.collective_timeout(cfg.parallel.step_timeout_s)
                stop, timed_save = boundary.decide()
                if stacks is not None:
                    stacks.disarm()
                prof.step()
                pending.steps.append((self.step, out, data_wait))
                last = self.step == cfg.training.steps
                evaluate = bool(cfg.training.eval_interval) and not last and stop is None \
                    and self.step % cfg.training.eval_interval == 0
                save = not last and (bool(stop) or timed_save or (
                    bool(cfg.checkpoint.interval) and self.step % cfg.checkpoint.interval == 0))
                if (last or evaluate or save or self.step == first
                        or self.step % cfg.metrics.log_interval == 0):
                    self._log_pending(pending, metrics, result)
                if evaluate:
                    self._where(heartbeat, "evaluation")
                    metrics.log_eval(self.step, self.evaluate())
                    pending.since = time.perf_counter()  # evaluation time is not step time
                if save:
                    self._where(heartbeat, "saving a checkpoint")
                    result.checkpoint = self.save_checkpoint()
                    boundary.saved()
                    pending.since = time.perf_counter()
                if stop is not None and not last:  # the last step ends the run as usual
                    result.checkpoint = self.checkpointer.wait() or result.checkpoint
                    if self.is_main:
                        write_marker(self.output, stop, self.step, result.checkpoint)
                    raise Preempted(stop, self.step, result.checkpoint)
            prof.stop()  # evaluation and the final checkpoint stay out of the trace
            self.diagnosis = diagnose_window(prof, cfg, metrics, self.step, self.par.enabled,
                                             self.is_main)
            self._where(heartbeat, "final evaluation")
            result.val_loss = self.evaluate()
            metrics.log_eval(self.step, result.val_loss)
            # The last step is saved by `save_final`, or as any step of `interval` is.
            on_interval = bool(cfg.checkpoint.interval) and self.step > result.steps \
                and self.step % cfg.checkpoint.interval == 0
            if cfg.checkpoint.save_final or on_interval:
                self._where(heartbeat, "saving the final checkpoint")
                result.checkpoint = self.save_checkpoint()
            result.checkpoint = self.checkpointer.wait() or result.checkpoint
        finally:
            boundary.uninstall()
            if stacks is not None:
                stacks.close()
            prof.stop()
            metrics.close()
            self.checkpointer.close()
            if heartbeat is not None:
                heartbeat.stop()
        result.steps = self.step
        result.tokens_seen = self._tokens_seen()
        result.wall_time_s = time.perf_counter() - start
        if cfg.training.sample_tokens:
            result.sample = self.sample(cfg.training.sample_tokens)
        return result

    def _tokens_seen(self) -> int:
        return self.train_stream.state_dict()["consumed_samples"] * self.cfg.data.seq_len

    def _stack_dumps(self) -> Any:
        """Stack dumps of a hung step (several processes only; `parallel/stacks.py`)."""
        if not self.par.enabled:
            return None
        from scaletrain.parallel.stacks import StackDumps

        return StackDumps(self.output / "stacks", self.par.rank,
                          on_demand="SIGUSR2" not in self.cfg.checkpoint.signals)

    def _where(self, heartbeat: Any, doing: str) -> None:
        """Tell the heartbeat where this rank is (named if it stops answering)."""
        if heartbeat is not None:
            heartbeat.at(f"step {self.step + 1}: {doing}" if doing == "training step"
                         else f"after step {self.step}: {doing}")

    def _log_pending(self, pending: _Pending, metrics: Any, result: TrainResult) -> None:
        """Read the pending steps back (one transfer; the only host synchronization of the
        loop), log each step's metrics and apply `training.on_nan`."""
        if not pending.steps:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        values = torch.stack([torch.stack([o.loss.float(), o.grad_norm.float(),
                                           o.skipped.float()]) for _, o, _ in pending.steps])
        rows = values.cpu().tolist()
        # Steps are not synchronized one by one: each gets the interval's mean step time.
        step_time = (now - pending.since) / len(pending.steps)
        tokens = self.ga * self.mbs * self.dp_size * self.cfg.data.seq_len
        steps, pending.steps, pending.since = pending.steps, [], now
        moe = collect_moe_stats(self.model, self.par) if self.has_moe else None
        for (step, _, data_wait), (loss, norm, skipped) in zip(steps, rows, strict=True):
            if skipped:
                self._on_nonfinite(loss, step)
                norm = float("nan")
            result.losses.append(loss)
            metrics.log_step(step_metrics(
                step=step, loss=loss, lr=self.schedule.lr_at(step - 1), grad_norm=norm,
                tokens=tokens, step_time_s=step_time, data_wait_s=data_wait,
                world_size=self.par.dims.world_size, flops_per_token=self.flops_per_token,
                peak_flops=self.peak_flops, baseline=self.mem_baseline,
                peak_flops_fp8=self.peak_flops_fp8,
                moe=moe if step == steps[-1][0] else None))

    def sample(self, max_new_tokens: int) -> str | None:
        """A sampled continuation of a line of the validation text (see `train.sample`);
        None with several processes (the model is sharded)."""
        if self.par.enabled:
            return None
        from scaletrain.train.sample import sample_text

        return sample_text(self.model_args, self.model.state_dict(), self.device,
                           self.corpus.val, self.corpus.tokenizer_path, self.corpus.eos_id,
                           max_new_tokens, self.cfg.training.seed)


@dataclass
class _Pending:
    """Steps run but not yet read back: (step, outputs, data wait), since when."""

    since: float
    steps: list[tuple[int, StepOutput, float]] = field(default_factory=list)


class _NoMetrics:
    """What ranks other than 0 log: nothing."""

    def log_step(self, *_: Any) -> None: ...

    def log_eval(self, *_: Any) -> None: ...

    def close(self) -> None: ...
