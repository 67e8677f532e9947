"""The training loop: the only place where model, techniques, data and optimizer meet."""

from __future__ import annotations

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

from scaletrain.config import Config, ConfigError, resolve_batch, to_toml
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import Transformer, build_model
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.parallelize import Parallelism
from scaletrain.plan.flops import flops_per_token
from scaletrain.plan.hardware import device_name, peak_tflops
from scaletrain.profiling.capture import StepProfiler, phase
from scaletrain.runtime import resolve_device
from scaletrain.train import precision
from scaletrain.train.checkpoint import Checkpointer, CheckpointError, rng_state, set_rng_state
from scaletrain.train.loss import count_valid, cross_entropy_sum
from scaletrain.train.lr_schedule import LRSchedule
from scaletrain.train.metrics import MemoryBaseline, MetricsLogger, step_metrics
from scaletrain.train.optim import build_optimizer

log = logging.getLogger("scaletrain.train")

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
        # Degrees from the config and torchrun's world size; checked before any collective.
        self.par = Parallelism(cfg.parallel, self.device)
        self.is_main = self.par.is_main
        seed_everything(cfg.training.seed, cfg.training.deterministic)
        self.output = Path(cfg.output)
        self.output.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            (self.output / "config.toml").write_text(to_toml(cfg))
        self.dtype = precision.resolve_dtype(cfg.precision, self.device)
        if cfg.precision.param_dtype == "bf16" and self.dtype == "fp16":
            raise ConfigError("precision.param_dtype bf16 cannot be combined with fp16 autocast; "
                              "use precision.dtype bf16")
        if cfg.optimizer.offload and self.dtype == "fp16":
            raise ConfigError("optimizer.offload does not support fp16 loss scaling; "
                              "use precision.dtype bf16 or fp32")
        self.ga = resolve_batch(cfg.training, self.par.dims.dp)[1]  # GBS = MBS x GA x DP
        self.mbs = cfg.training.micro_batch_size
        if self.par.enabled:
            self._check_distributed()
        # This rank's place among the data-parallel ranks (the parallelism layer sets them).
        self.dp_rank, self.dp_size = self.par.dp_rank, self.par.dp_size
        self._build_data()
        self.mem_baseline = MemoryBaseline(self.device)  # peaks are reported above it
        self.model_args = self._model_args()
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        if self.par.dims.pp > 1:
            self.par.attach_pipeline(self.model, cross_entropy_sum, self.ga)
        if cfg.precision.param_dtype == "bf16":
            for p in self.model.parameters():  # buffers (RoPE frequencies) stay fp32
                p.data = p.data.to(torch.bfloat16)
        self.schedule = LRSchedule(self.optimizer, cfg.lr_schedule, cfg.optimizer.lr,
                                   cfg.training.steps)
        self.scaler = precision.grad_scaler(self.device, self.dtype)
        self.loss_fn = cross_entropy_sum
        if cfg.compile.enabled and not self.par.enabled:
            self.loss_fn = torch.compile(cross_entropy_sum)
        self.checkpointer = self.checkpointer_cls(self.output / "checkpoints",
                                                  cfg.checkpoint.keep_last, self.model_args,
                                                  self.corpus.tokenizer_path)
        self.step = 0
        if cfg.checkpoint.resume:
            self._resume()
        self.flops_per_token = flops_per_token(self.model_args, cfg.data.seq_len)
        peak = peak_tflops(device_name(self.device), self.dtype)
        self.peak_flops = None if peak is None else peak * 1e12
        if self.peak_flops is None:
            log.warning("MFU: no peak-FLOPS entry for device '%s' in %s; mfu is reported as null",
                        device_name(self.device), self.dtype)

    # --- construction -----------------------------------------------------------------------
    def _check_distributed(self) -> None:
        """Layout problems as one message, then the process group and the mesh."""
        if self.dtype == "fp16":
            raise ConfigError("fp16 loss scaling is not supported with several processes; "
                              "use precision.dtype bf16 or fp32")
        if self.cfg.precision.param_dtype == "bf16" or self.cfg.optimizer.offload:
            raise ConfigError("precision.param_dtype bf16 and optimizer.offload are single-"
                              "process options; with several processes use "
                              "parallel.fsdp_param_dtype bf16 and parallel.cpu_offload")
        self.par.validate(self.cfg.model.to_model_args(), self.cfg.data.seq_len, self.ga)
        self.par.start()
        self.is_main = self.par.is_main

    def _build_optimizer(self) -> Any:
        cfg = self.cfg
        if self.par.mode == "zero1" and self.par.enabled:
            from scaletrain.parallel.ddp import zero1_optimizer
            from scaletrain.train.optim import param_groups

            if cfg.optimizer.name != "adamw":
                raise ConfigError("parallel.data_parallel zero1 supports optimizer.name adamw")
            o = cfg.optimizer
            return zero1_optimizer(param_groups(self.model, o.weight_decay), torch.optim.AdamW,
                                   self.par.mesh["dp_cp"], lr=o.lr, betas=(o.beta1, o.beta2),
                                   eps=o.eps)
        return build_optimizer(self.model, cfg.optimizer, self.device, cfg.precision.param_dtype)

    def _build_data(self) -> None:
        from scaletrain.data.loader import build_train_val

        pin = self.cfg.data.pin_memory
        if pin is None:
            pin = self.device.type == "cuda"
        self.pin_memory = pin
        # The samples the whole run consumes (GBS x steps); the order of the first ones does
        # not depend on it, so a resumed run with more steps continues the same order.
        num_samples = self.cfg.training.steps * self.mbs * self.ga * self.dp_size
        self.train_stream, self.val_data, self.corpus = build_train_val(
            self.cfg.data, self.mbs, self.cfg.training.seed, pin_memory=pin,
            dp_rank=self.dp_rank, dp_size=self.dp_size, num_samples=num_samples,
        )

    def _model_args(self) -> ModelArgs:
        args = self.cfg.model.to_model_args()
        if self.corpus.vocab_size > args.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.corpus.vocab_size} tokens but model.vocab_size is "
                f"{args.vocab_size}; set --model.vocab_size {self.corpus.vocab_size} or a smaller "
                "--data.vocab_size"
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
        apply_ac(model, self.cfg.activation_checkpoint)
        apply_compile(model, self.cfg.compile)
        model.train()
        return model

    # --- state ------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "lr_schedule": self.schedule.state_dict(),
            "data": self.train_stream.state_dict(),
            "rng": rng_state(),
        }
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        return extra

    def _resume(self) -> None:
        steps = self.checkpointer.steps()
        if not steps:
            raise CheckpointError(
                f"checkpoint.resume is true but no complete checkpoint exists under "
                f"{self.checkpointer.folder}; run without --checkpoint.resume to start fresh"
            )
        extra = self.checkpointer.load(self.checkpointer.path(steps[-1]), self.model,
                                       self.optimizer, self._extra_state())
        self.schedule.load_state_dict(extra["lr_schedule"])
        self.train_stream.load_state_dict(extra["data"])
        set_rng_state(extra["rng"])
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        self.step = int(extra["step"])

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.model, self.optimizer, self._extra_state())

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

    def train_step(self, batches: list[Batch]) -> tuple[float, float]:
        """Forward/backward over the micro-batches, then one optimizer step.

        The loss is the sum of token losses over all micro-batches divided by their total
        count of valid tokens, so any split into micro-batches gives the same gradients.
        Returns (loss, grad_norm); the loss is NaN/inf when the step was skipped.
        """
        n_valid = sum(count_valid(y) for _, y in batches).clamp(min=1)
        if self.par.enabled:  # every rank divides by the count over all data-parallel ranks
            n_total = float(self.par.all_reduce(n_valid.double(), "dp"))
            local = self.par.forward_backward(
                self.model, batches, n_total, self.loss_fn,
                lambda: precision.autocast(self.device, self.dtype), self.model_forward)
            loss = self.par.step_loss(local)
        else:
            loss_sum = torch.zeros((), device=self.device)
            for x, y in batches:
                with phase("forward"):
                    with precision.autocast(self.device, self.dtype):
                        logits = self.model_forward(x)
                    token_loss = self.loss_fn(logits, y)
                scaled = token_loss / n_valid
                with phase("backward"):
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                loss_sum += token_loss.detach()
            loss = (loss_sum / n_valid).item()
        if not math.isfinite(loss):
            self._on_nonfinite(loss)
            self.optimizer.zero_grad(set_to_none=True)
            self.schedule.step()
            return loss, float("nan")
        with phase("optimizer"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            max_norm = self.cfg.training.max_grad_norm or float("inf")
            if self.par.enabled:
                grad_norm = self.par.clip_grad_norm(self.model, max_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return loss, float(grad_norm)

    def model_forward(self, x: Any) -> torch.Tensor:
        """Logits for one micro-batch's inputs (fine-tuning passes inputs beyond token ids)."""
        return self.model(x)

    def _guarded_step(self, batches: list[Batch], heartbeat: Any) -> tuple[float, float]:
        """train_step; with several processes a failed collective becomes one clear error
        naming the rank that stopped (the others exit within parallel.timeout_s)."""
        if heartbeat is None:
            return self.train_step(batches)
        from scaletrain.parallel.failure import DistributedFailure, describe_failure

        try:
            return self.train_step(batches)
        except RuntimeError as e:
            if isinstance(e, TrainingDiverged):
                raise
            raise DistributedFailure(describe_failure(heartbeat, self.step + 1, e)) from None

    def _on_nonfinite(self, loss: float) -> None:
        step = self.step + 1
        causes = ("learning rate too high (optimizer.lr, lr_schedule.warmup_steps), fp16 overflow "
                  "(use bf16 or keep the loss scaler), a bad batch, or no gradient clipping "
                  "(training.max_grad_norm)")
        if self.cfg.training.on_nan == "stop":
            raise TrainingDiverged(f"loss is {loss} at step {step}; likely causes: {causes}. "
                                   "Set --training.on_nan skip to skip such steps.")
        log.warning("loss is %s at step %d: optimizer step skipped (likely causes: %s)",
                    loss, step, causes)

    # --- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        from scaletrain.data.loader import iter_eval_batches

        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device, dtype=torch.long)
        batches = iter_eval_batches(self.val_data, self.mbs, self.cfg.training.eval_batches)
        if self.par.enabled:  # every rank sees the same validation batches
            loss = self.par.evaluate(self.model, batches, cross_entropy_sum,
                                     lambda: precision.autocast(self.device, self.dtype))
            self.model.train()
            return loss
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with precision.autocast(self.device, self.dtype):
                logits = self.model(x)
            total += cross_entropy_sum(logits, y)
            count += count_valid(y)
        self.model.train()
        return (total / count.clamp(min=1)).item()

    # --- the loop ---------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg = self.cfg
        start = time.perf_counter()
        result = TrainResult(steps=self.step)
        heartbeat = None
        if self.par.enabled:
            from scaletrain.parallel.failure import Heartbeat

            heartbeat = Heartbeat()
        tokens_per_step = self.ga * self.mbs * self.dp_size * cfg.data.seq_len
        metrics: Any = _NoMetrics()
        if self.is_main:  # one rank writes metrics, logs and the progress bar
            metrics = MetricsLogger(self.output, cfg.training.steps, cfg.metrics.log_interval,
                                    cfg.metrics.tensorboard, cfg.metrics.progress_bar,
                                    start_step=self.step)
        prof = StepProfiler(cfg.profiling, self.output, self.device, start_step=self.step).start()
        try:
            while self.step < cfg.training.steps:
                t0 = time.perf_counter()
                batches = self.next_batches()
                data_wait = time.perf_counter() - t0
                with prof.oom_guard(cfg):
                    loss, grad_norm = self._guarded_step(batches, heartbeat)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                step_time = time.perf_counter() - t0
                self.step += 1
                prof.step()
                result.losses.append(loss)
                metrics.log_step(step_metrics(
                    step=self.step, loss=loss, lr=self.schedule.lr_at(self.step - 1),
                    grad_norm=grad_norm, tokens=tokens_per_step, step_time_s=step_time,
                    data_wait_s=data_wait, world_size=self.par.dims.world_size,
                    flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
                    baseline=self.mem_baseline))
                last = self.step == cfg.training.steps
                if cfg.training.eval_interval and self.step % cfg.training.eval_interval == 0 \
                        and not last:
                    metrics.log_eval(self.step, self.evaluate())
                if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0 \
                        and not last:
                    result.checkpoint = self.save_checkpoint()
            prof.stop()  # evaluation and the final checkpoint stay out of the trace
            result.val_loss = self.evaluate()
            metrics.log_eval(self.step, result.val_loss)
            if cfg.checkpoint.save_final:
                result.checkpoint = self.save_checkpoint()
        finally:
            prof.stop()
            metrics.close()
            if heartbeat is not None:
                heartbeat.stop()
        result.steps = self.step
        result.wall_time_s = time.perf_counter() - start
        if cfg.training.sample_tokens and not self.par.enabled:
            result.sample = self.sample(cfg.training.sample_tokens)
        return result

    def sample(self, max_new_tokens: int) -> str | None:
        """Greedy continuation of the start of the validation data, decoded (for a quick look)."""
        from tokenizers import Tokenizer

        from scaletrain.models.generation import generate

        plain = build_model(self.model_args, self.device)  # no AC/compile wrappers
        plain.load_state_dict(self.model.state_dict())
        plain.eval()
        prompt = [int(t) for t in self.corpus.val[:24]]
        new = generate(plain, prompt, max_new_tokens, temperature=0.0, eos_id=self.corpus.eos_id)
        tokenizer = Tokenizer.from_file(str(self.corpus.tokenizer_path))
        return tokenizer.decode(prompt) + "\u2588" + tokenizer.decode(new)


class _NoMetrics:
    """What ranks other than 0 log: nothing."""

    def log_step(self, *_: Any) -> None: ...

    def log_eval(self, *_: Any) -> None: ...

    def close(self) -> None: ...
