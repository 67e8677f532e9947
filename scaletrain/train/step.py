"""The one training step, for every layout: single process, DDP/ZeRO/FSDP/TP/CP and pipeline.

`TrainStep(...)(batches)` runs a step's micro-batches under the run's autocast, divides the
summed token losses by the global count of valid tokens (over accumulation and data-parallel
ranks), scales them for fp16, clips the gradient norm and steps the optimizer. It returns device
tensors and never reads a value back to the host: a non-finite loss or gradient norm skips the
optimizer update on the device (the `found_inf` input of fused optimizers and of the fp16
scaler), and the trainer acts on it (`training.on_nan`) when it next logs. Optimizers without a
`found_inf` input (for-loop/foreach kernels, Adafactor, 8-bit AdamW, master weights, ZeRO-1) read
the flag on the host before their update: one synchronization per step, named in docs/train.md.

What differs between layouts is asked of `Parallelism` (its methods are no-ops for one process):
the context-parallel slice of a batch, vocabulary-parallel loss, what each micro-batch reduces
(DDP's `no_sync`, HSDP's deferred all-reduce), the pipeline schedule, the reduction groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.models.moe import aux_loss_weighting, moe_layers, update_expert_bias
from scaletrain.parallel.grad import clip_grad_norm
from scaletrain.parallel.parallelize import Parallelism
from scaletrain.profiling.capture import phase
from scaletrain.train import precision
from scaletrain.train.loss import count_valid

Batch = tuple[Any, torch.Tensor]


@dataclass
class StepOutput:
    """One step's results, as device tensors (read them at log steps only)."""

    loss: torch.Tensor
    """The step's loss: summed token losses over the global valid-token count (fp32 scalar)."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping (fp32 scalar; inf/NaN when the step skipped)."""
    skipped: torch.Tensor
    """True where the loss (or, without a loss scaler, the gradient norm) was not finite and the
    optimizer update was skipped."""


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a possibly distributed one (a vocabulary-parallel loss, a
    parameter FSDP shards); a collective for a DTensor, so every rank of its mesh calls it."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class TrainStep:
    """Forward/backward over a step's micro-batches, then clipping and the optimizer.

    `forward(inputs) -> logits` is what one micro-batch's inputs go through (fine-tuning passes
    dictionaries; under context parallelism it is called as `forward(inputs, positions=...)`);
    `loss_fn(logits, targets)` returns the sum of token losses (with `training.fused_loss` the
    forward returns hidden states and the loss applies the head).
    """

    def __init__(self, model: nn.Module, optimizer: Any, par: Parallelism, device: torch.device,
                 dtype: str, loss_fn: Callable[..., torch.Tensor], max_grad_norm: float | None,
                 scaler: torch.amp.GradScaler | None = None,
                 forward: Callable[[Any], torch.Tensor] | None = None) -> None:
        self.model, self.optimizer, self.par = model, optimizer, par
        self.device, self.dtype = device, dtype
        self.loss_fn, self.max_grad_norm, self.scaler = loss_fn, max_grad_norm, scaler
        self.forward = forward or model
        self.has_moe = any(True for _ in moe_layers(model))
        if scaler is not None:  # create its scale now: pipeline stages without the loss never
            scaler.scale(torch.zeros((), device=device))  # call `scale` themselves

    def autocast(self) -> contextlib.AbstractContextManager:
        return precision.autocast(self.device, self.dtype)

    def _scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def __call__(self, batches: list[Batch]) -> StepOutput:
        par = self.par
        # Every rank divides by the count over all data-parallel ranks (a device tensor).
        n_valid = sum(count_valid(y) for _, y in batches)
        n_valid = par.all_reduce(torch.as_tensor(n_valid, device=self.device).float(), "dp")
        n_valid = n_valid.clamp(min=1)
        with par.loss_context(), self._moe_weighting(batches):
            if par.schedule is not None:
                loss_sum = par.pipeline_forward_backward(batches, n_valid, self._scale)
            else:
                loss_sum = self._micro_batches(batches, n_valid)
        loss = par.reduce_loss(loss_sum) / n_valid
        par.reduce_tied_gradients(self._holder)  # a tied head under PP only
        par.sync_gradients(self._sync_params())  # ZeRO-0/1 with TP/PP only
        with phase("optimizer"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            params = [p for p in self._grad_params() if p.grad is not None]
            copies = [self._holder(p) for p in par.tied_parameters()] if par.tied_copy else []
            grad_norm = clip_grad_norm(params, self.max_grad_norm, par.pp_group, self.device,
                                       copies)
            bad = ~torch.isfinite(loss)
            if self.scaler is None:  # the scaler skips inf/NaN gradients itself
                bad = bad | ~torch.isfinite(grad_norm)
            self._optimizer_step(bad)
            par.precompute_fp8_scales(self.model)  # FSDP's fp8 all-gather only
            self.optimizer.zero_grad(set_to_none=True)
            if self.has_moe:  # auxiliary-loss-free balancing (no-op unless configured)
                update_expert_bias(self.model, lambda t: par.all_reduce(t, "dp_cp"))
        return StepOutput(loss.detach(), grad_norm, bad)

    def _holder(self, p: torch.Tensor) -> Any:
        """What holds parameter p's gradient in `.grad`: p, or the fp32 buffer an optimizer
        with master weights accumulates it in."""
        holder = getattr(self.optimizer, "grad_holder", None)
        return p if holder is None else holder(p)

    def _sync_params(self) -> list[Any]:
        """The gradient holders the data-parallel reduction of ZeRO-0/1 with TP/PP sums."""
        holders = getattr(self.optimizer, "sync_params", None)
        return list(self.model.parameters()) if holders is None else holders()

    def _grad_params(self) -> list[torch.Tensor]:
        """What holds the step's gradients: the model's parameters, or, for an optimizer that
        accumulates 16-bit parameters' gradients in fp32 buffers (`MasterWeightOptimizer`),
        the tensors it names (clipping and the norm then read the fp32 sums)."""
        grad_params = getattr(self.optimizer, "grad_params", None)
        return list(self.model.parameters()) if grad_params is None else grad_params()

    def _moe_weighting(self, batches: list[Batch]) -> contextlib.AbstractContextManager:
        """MoE auxiliary losses weighted by each forward's share of the step's tokens (all
        micro-batches, all data-parallel ranks) and by the fp16 loss scale."""
        if not self.has_moe:
            return contextlib.nullcontext()
        step_tokens = sum(y.numel() for _, y in batches) * self.par.dp_size
        loss_scale = (None if self.scaler is None
                      else self._scale(torch.ones((), device=self.device)))
        return aux_loss_weighting(step_tokens, loss_scale)

    def _micro_batches(self, batches: list[Batch], n_valid: torch.Tensor) -> torch.Tensor:
        """Forward and backward of each micro-batch; the sum of this rank's token losses."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        last = len(batches) - 1
        for i, (x, y) in enumerate(batches):
            x, y, positions = self.par.shard_batch(x, y)
            with self.par.micro_batch_sync(self.model, i == last):
                with phase("forward"):
                    with self.autocast():
                        logits = (self.forward(x) if positions is None
                                  else self.forward(x, positions=positions))
                    token_loss = self.loss_fn(logits, y)
                with phase("backward"):
                    self._scale(token_loss / n_valid).backward()
            loss_sum += full_value(token_loss.detach()).float()
        return loss_sum

    def _optimizer_step(self, bad: torch.Tensor) -> None:
        """The update, skipped where `bad` is true, without reading `bad` on the host when the
        optimizer (or the fp16 scaler) can take it on the device."""
        opt = self.optimizer
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        elif getattr(opt, "_step_supports_amp_scaling", False):
            opt.found_inf, opt.grad_scale = bad.float(), None
            try:
                opt.step()
            finally:
                del opt.found_inf, opt.grad_scale
        elif not bool(bad):  # host read: this optimizer cannot skip on the device
            opt.step()
