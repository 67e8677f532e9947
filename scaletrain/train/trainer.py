"""The trainer: the only place where model, techniques, data and optimizer meet. `Trainer`
builds a run from a `Config` and runs its steps and evaluation; its loop (`trainer_loop.py`)
and its checkpoints (`trainer_checkpoints.py`) are its other parts."""

from __future__ import annotations

import functools
import logging
import math
import os
import random
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
from scaletrain.profiling.capture import phase
from scaletrain.runtime import resolve_device
from scaletrain.train import precision, rng
from scaletrain.train.checkpoint import Checkpointer
from scaletrain.train.evaluate import evaluate
from scaletrain.train.host_allocator import (
    apply_mmap_threshold,
    glibc,
    malloc_trim,
    trim_after_forward,
)
from scaletrain.train.loss import cross_entropy_sum
from scaletrain.train.lr_schedule import LRSchedule
from scaletrain.train.metrics import MemoryBaseline
from scaletrain.train.optim import build_optimizer
from scaletrain.train.step import StepOutput, TrainStep
from scaletrain.train.trainer_checkpoints import TrainerCheckpoints
from scaletrain.train.trainer_loop import TrainingLoop

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite and `training.on_nan` is `stop`."""




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


class Trainer(TrainingLoop, TrainerCheckpoints):
    """Builds everything a run needs from a validated `Config`, then `train()` runs it (the
    loop: `train/trainer_loop.py`; checkpoints and resuming: `train/trainer_checkpoints.py`)."""

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

    def sample(self, max_new_tokens: int) -> str | None:
        """A sampled continuation of a line of the validation text (see `train.sample`);
        None with several processes (the model is sharded)."""
        if self.par.enabled:
            return None
        from scaletrain.train.sample import sample_text

        return sample_text(self.model_args, self.model.state_dict(), self.device,
                           self.corpus.val, self.corpus.tokenizer_path, self.corpus.eos_id,
                           max_new_tokens, self.cfg.training.seed)
