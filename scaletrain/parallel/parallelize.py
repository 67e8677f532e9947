"""Parallelism: the trainer's one handle on distributed training.

From `ParallelConfig` and the world size it resolves the degrees (`ParallelDims`), validates
them against the model before any process-group work, starts the process group, builds the
named mesh and the model in the order PP split -> TP -> EP -> CP -> activation checkpointing ->
compile -> FSDP/DDP (on the meta device, materialized after sharding), and runs one step's
forward/backward with the loss normalized by the global valid-token count (through the
pipeline schedule: `pipeline_run.py`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from scaletrain.config import ActivationCheckpointConfig, CompileConfig, ParallelConfig
from scaletrain.models.args import ModelArgs
from scaletrain.models.moe import moe_layers
from scaletrain.models.rope import inverse_frequencies
from scaletrain.models.transformer import Transformer, build_model, init_values
from scaletrain.parallel import cp as cp_lib
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.ddp import apply_ddp
from scaletrain.parallel.dims import ParallelDims, ParallelDimsError
from scaletrain.parallel.ep import apply_ep
from scaletrain.parallel.feasibility import (
    RunLayout,
    layout_problems,
    reshards_after_forward,
    resolve_mode,
    runs_torch_ddp,
)
from scaletrain.parallel.fp8 import apply_fp8, fsdp_all_gather, precompute_scales
from scaletrain.parallel.fsdp import apply_fsdp
from scaletrain.parallel.mesh import ParallelMesh, env_world, init_process_group
from scaletrain.parallel.pipeline_run import PipelineParallelism
from scaletrain.parallel.pp import StageModule, prune_for_stages
from scaletrain.parallel.tp import apply_tp

log = logging.getLogger(__name__)

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def clean_name(name: str) -> str:
    """A parameter name without the activation-checkpoint/compile/DDP wrapper segments."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


class Parallelism(PipelineParallelism):
    """Resolved layout + mesh + the per-step distributed operations (those of pipeline
    parallelism: `parallel/pipeline_run.py`)."""

    def __init__(self, cfg: ParallelConfig, device: torch.device,
                 world_size: int | None = None, fp8: str = "none",
                 param_dtype: str = "fp32") -> None:
        self.cfg, self.device = cfg, device
        self.fp8 = fp8
        """`precision.fp8`: the linears become torchao float8 linears before any wrapping."""
        self.param_dtype = param_dtype
        """`precision.param_dtype`: with several processes, 16-bit parameters are FSDP's
        mixed precision under ZeRO-2/3 (its fp32 shards are the master weights) and the
        partitioned optimizer's fp32 masters otherwise (`train/zero1.py`)."""
        self.rank, world, _ = env_world()
        world = world_size or world
        self.dims = ParallelDims.resolve(world, pp=cfg.pp, dp_replicate=cfg.dp_replicate,
                                         dp_shard=cfg.dp_shard, cp=cfg.cp, tp=cfg.tp,
                                         ep=cfg.ep)
        self.enabled = world > 1
        self.mode = resolve_mode(cfg.data_parallel, self.dims)
        self.mesh: ParallelMesh | None = None
        self.dp_rank, self.dp_size = 0, 1
        self.cp_rank, self.pp_rank = 0, 0
        self.schedule = None
        self.run_microbatches = 0
        self._units: list[FSDPModule] = []  # `_fsdp_units`' cache, and the model it is of
        self._units_of: nn.Module | None = None
        self.stage_specs: list = []
        self.stage_modules: list[nn.Module] = []
        self.grad_sync_group: dist.ProcessGroup | None = None
        self.tied_group: dist.ProcessGroup | None = None
        """Pipeline parallelism with a tied head: this rank's embedding group (the ranks of
        its pipeline's first and last stage), None where the rank holds neither end."""
        self.tied_copy = False
        """This rank holds the tied head's second copy (the last stage, not the first): its
        gradient is left out of the gradient norm, which sums the stages."""
        self._tied_model: nn.Module | None = None
        self.fp8_all_gather = False
        """FSDP all-gathers fp8 weights: their scales are precomputed after each optimizer
        step (`precompute_fp8_scales`)."""

    # --- validation and start-up -----------------------------------------------------------
    def problems(self, args: ModelArgs, seq_len: int, grad_accum: int) -> list[str]:
        """Everything wrong with this layout for this model, before any process-group work
        (the feasibility check the planner and the search ask too)."""
        cfg = self.cfg
        return layout_problems(args, RunLayout(
            dims=self.dims, mode=self.mode, seq_len=seq_len, grad_accum=grad_accum,
            pp_schedule=cfg.pp_schedule, pp_virtual_stages=cfg.pp_virtual_stages,
            pp_microbatches=cfg.pp_microbatches, cpu_offload=cfg.cpu_offload,
            sequence_parallel=cfg.sequence_parallel, fp8=self.fp8,
            param_dtype=self.param_dtype))

    def validate(self, args: ModelArgs, seq_len: int, grad_accum: int) -> None:
        problems = self.problems(args, seq_len, grad_accum)
        if problems:
            raise ParallelDimsError("parallel layout cannot run:\n  - " + "\n  - ".join(problems))

    def start(self) -> None:
        """Start the process group and build the mesh (a no-op for one process)."""
        if not self.enabled:
            return
        init_process_group(self.device, self.cfg.timeout_s)
        self.rank = dist.get_rank()
        if self.rank != 0:  # one rank logs; the others report errors only
            logging.getLogger("scaletrain").setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flattened dim.*")
            self.mesh = ParallelMesh(self.dims, self.device.type)
        self.dp_rank, self.dp_size = self.mesh.coordinate("dp")
        self.cp_rank = self.mesh.coordinate("cp")[0]
        self.pp_rank = self.mesh.coordinate("pp")[0]
        log.info("layout %s, data parallel %s", self.dims.mesh_shape, self.mode)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather_objects(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order ([obj] for one process)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def heartbeat(self) -> Any:
        """A started `failure.Heartbeat` (None for one process): names a rank that stops."""
        if not self.enabled:
            return None
        from scaletrain.parallel.failure import Heartbeat

        return Heartbeat()

    # --- model -----------------------------------------------------------------------------
    def build_model(self, args: ModelArgs, seed: int, ac: ActivationCheckpointConfig,
                    compile_cfg: CompileConfig) -> nn.Module:
        """The model of this rank, parallelized and initialized exactly like the
        single-process model built with the same seed."""
        assert self.mesh is not None
        d, cfg, mesh = self.dims, self.cfg, self.mesh
        if self.ddp_wrapped:
            model = build_model(args, self.device, seed=seed)
            apply_fp8(model, self.fp8, self.device)
            if d.cp > 1:
                cp_lib.apply_cp(model, mesh["cp"], cfg.cp_load_balance)
            self._set_balance_group(model)
            apply_ac(model, ac)
            apply_compile(model, compile_cfg, mesh.all_groups())
            return apply_ddp(model, mesh["dp_cp"], cfg.bucket_cap_mb)
        with torch.device("meta"):
            model = Transformer(args)
        self.hidden_dim = args.dim
        if d.pp > 1:
            self.stage_specs = prune_for_stages(model, self.pp_rank, d.pp, cfg.pp_virtual_stages,
                                                cfg.pp_schedule)
            if args.tie_embeddings:
                self._embedding_group(model)
        fsdp = self.fsdp
        # Float8 linears replace the plain ones on the meta model, before TP and FSDP wrap them.
        # FSDP alone all-gathers tensorwise-scaled weights in fp8; with TP it gathers them in
        # full precision (torchao's fp8 gather would scale each TP shard by its own amax).
        self.fp8_all_gather = fsdp and d.tp == 1 and fsdp_all_gather(self.fp8)
        apply_fp8(model, self.fp8, self.device, fsdp=self.fp8_all_gather)
        if d.tp > 1:  # float8 linears shard like plain ones; TP gathers bf16 activations
            # with expert parallelism the experts split over (ep, tp): `parallel/ep_tp.py`
            apply_tp(model, mesh["tp"], sequence_parallel=cfg.sequence_parallel,
                     loss_parallel=cfg.loss_parallel,
                     ep_tp_mesh=mesh.root["ep", "tp"] if d.ep > 1 else None)
        elif d.ep > 1:
            apply_ep(model, mesh["ep"])
        if d.cp > 1:
            cp_lib.apply_cp(model, mesh["cp"], cfg.cp_load_balance)
        apply_ac(model, ac)
        apply_compile(model, compile_cfg, mesh.all_groups())
        if compile_cfg.enabled and d.tp > 1 and model.tok_embeddings is not None:
            # The first compiled block must not get the embedding's `DTensor.to_local()` view:
            # AOTAutograd's input handling rebases that view's history, and its gradient would
            # then skip the DTensor conversion (a plain tensor reaches the embedding's
            # redistribute in backward). A copy of one (batch, seq, dim) activation avoids it.
            model.tok_embeddings.register_forward_hook(lambda _m, _i, out: out.clone())
        # Pipeline stages are views over the rank's model; each is its own FSDP root.
        shards = d.tp if d.tp > 1 and cfg.sequence_parallel else 1
        cp_of_stage = (self.cp_rank, d.cp, cfg.cp_load_balance) if d.cp > 1 else None
        self.stage_modules = [StageModule(model, spec, shards, cp_of_stage)
                              for spec in self.stage_specs]
        if d.dp_replicate * d.dp_shard * d.cp > 1 and self.mode in ("ddp", "zero1"):
            # ZeRO-0/1 with TP/PP: replicas of the sharded model, gradients all-reduced by the
            # step (`sync_gradients`) as Megatron's data parallelism does (ZeRO-1 then
            # partitions the optimizer: `train/zero1.py`).
            self.grad_sync_group = mesh.group("dp_cp")
        elif fsdp:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flattened dim.*")
                fsdp_mesh = (mesh.root["dp_replicate", "dp_shard_cp"] if d.dp_replicate > 1
                             else mesh["dp_shard_cp"])
            reshard = reshards_after_forward(self.mode, d.pp, cfg.pp_schedule)
            if self.mode == "zero3" and not reshard:
                log.info("ZeRO-3 under %s: the blocks of this rank's stages stay gathered from "
                         "forward to backward (the split backward needs them)", cfg.pp_schedule)
            for root in self.stage_modules or [model]:
                apply_fsdp(root, fsdp_mesh, reshard_after_forward=reshard,
                           param_dtype=self.fsdp_param_dtype,
                           reduce_dtype=cfg.fsdp_reduce_dtype, cpu_offload=cfg.cpu_offload,
                           expert_parallel=d.ep > 1, expert_mesh=self._expert_fsdp_mesh())
        self._materialize(model, args, seed)
        self._set_balance_group(model)
        return model

    @property
    def ddp_wrapped(self) -> bool:
        """DDP/ZeRO-1 of the whole model (no tensor or pipeline parallelism) with fp32
        parameters: torch's DDP. 16-bit parameters take the replicas' path (their fp32
        gradient buffers are reduced by the step)."""
        return runs_torch_ddp(self.mode in ("ddp", "zero1"), self.dims.tp, self.dims.pp,
                              self.param_dtype)

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the model: ZeRO-2/3 over more than one data-parallel rank."""
        d = self.dims
        return self.mode in ("zero2", "zero3") and d.dp_replicate * d.dp_shard * d.cp > 1

    @property
    def fsdp_param_dtype(self) -> str:
        """The dtype FSDP gathers (computes with): `parallel.fsdp_param_dtype`, or bf16 for
        16-bit parameters (`precision.param_dtype bf16`: the fp32 shards are the masters)."""
        return "bf16" if self.param_dtype == "bf16" else self.cfg.fsdp_param_dtype

    @property
    def master_weights(self) -> bool:
        """The trainer keeps 16-bit parameters with fp32 master weights itself (not FSDP)."""
        return self.param_dtype != "fp32" and not (self.enabled and self.fsdp)

    def micro_batch_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """What the backward of one micro-batch (of the step's accumulation, outside a pipeline
        schedule) reduces across the data-parallel ranks. The last reduces everything. Before
        it: DDP nothing (`no_sync`); HSDP only the reduce-scatter inside each shard group, the
        replicas' all-reduce waiting for the last micro-batch (FSDP2 keeps the partial sums:
        `set_requires_all_reduce`), which saves m - 1 all-reduces per step at the memory
        ZeRO-2/3 hold anyway; ZeRO-2/3 reduce-scatter every micro-batch (their gradients stay
        sharded). Pipeline schedules defer the whole reduction themselves."""
        if hasattr(model, "no_sync"):
            return contextlib.nullcontext() if last else model.no_sync()
        if self.fsdp and self.dims.dp_replicate > 1:
            for unit in self._fsdp_units(model):
                unit.set_requires_all_reduce(last, recurse=False)
        return contextlib.nullcontext()

    def _fsdp_units(self, model: nn.Module) -> list[FSDPModule]:
        """`model`'s FSDP units, found once (the step asks for them every micro-batch)."""
        if self._units_of is not model:
            self._units = [u for u in model.modules() if isinstance(u, FSDPModule)]
            self._units_of = model
        return self._units

    def reshard_stages(self) -> None:
        """Put every FSDP unit of this rank's pipeline stages at rest (sharded), as evaluation
        does when it ends. A stage's root unit stays gathered after a forward with no backward,
        and a state dict of the model (the stages are not its children, so FSDP's state-dict
        hooks do not run) would read the gathered parameters, whose storage FSDP frees at its
        next reshard. A no-op without pipeline parallelism."""
        for root in self.stage_modules:
            for unit in root.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    def precompute_fp8_scales(self, model: nn.Module) -> None:
        """After the optimizer step: the fp8 all-gather's weight scales for the next step (a
        no-op unless FSDP gathers fp8 weights)."""
        if self.fp8_all_gather:
            precompute_scales(model)

    @torch.no_grad()
    def sync_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """ZeRO-0/1 with TP/PP: sum the local gradients over the data-parallel ranks, in
        flattened buckets of `parallel.bucket_cap_mb` (a no-op in every other layout)."""
        if self.grad_sync_group is None:
            return
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in params if p.grad is not None]
        cap = int(self.cfg.bucket_cap_mb * 2**20)
        buckets: dict[tuple, list[list[torch.Tensor]]] = {}
        for g in grads:
            lists = buckets.setdefault((g.device, g.dtype), [[]])
            if lists[-1] and sum(t.numel() for t in lists[-1]) * g.element_size() >= cap:
                lists.append([])
            lists[-1].append(g)
        for lists in buckets.values():
            for bucket in lists:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=self.grad_sync_group)
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                    g.copy_(part.view_as(g))

    def _expert_fsdp_mesh(self) -> Any:
        """With expert parallelism, the dp_shard ranks that hold the same experts (None when
        each expert lives on one rank only)."""
        d = self.dims
        return self.mesh["dp_shard_mod_ep"] if d.ep > 1 and d.dp_shard_mod_ep > 1 else None

    def _set_balance_group(self, model: nn.Module) -> None:
        """The ranks whose expert counts MoE balancing losses sum: for scope `sequence` the
        context-parallel ranks (each holds a part of the same sequences; every other
        dimension keeps sequences whole), for scope `micro_batch` all data-parallel ranks."""
        for _, moe in moe_layers(model):
            dim = "cp" if moe.aux_scope == "sequence" else "dp_cp"
            moe.balance_group = self.mesh.group(dim) if self.mesh[dim].size() > 1 else None

    def _materialize(self, model: nn.Module, args: ModelArgs, seed: int) -> None:
        """Allocate this rank's shards and fill them with the values the single-process model
        gets from `seed`: each rank draws them one parameter at a time on the CPU (peak: one
        full parameter, never the whole model) and keeps its slices."""
        target = "cpu" if self.cfg.cpu_offload else self.device
        model.to_empty(device=target)
        if args.tie_embeddings and model.output is not None and model.tok_embeddings is not None \
                and model.output.weight is not model.tok_embeddings.weight:
            # `to_empty` gave each name of a plain (not FSDP or TP) shared parameter its own
            # tensor: the pipeline's last stage ties its head to the embedding again
            model.output.weight = model.tok_embeddings.weight
        local = {clean_name(name): p for name, p in model.named_parameters()}
        with torch.no_grad():
            for name, full in init_values(args, seed):
                p = local.pop(name, None)
                if p is None:  # another pipeline stage's parameter (drawn to keep the RNG)
                    continue
                if isinstance(p, DTensor):
                    part = distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                             src_data_rank=None)
                    p.to_local().copy_(part.to_local())
                else:
                    p.copy_(full)
        if local:
            raise RuntimeError(f"parameters without an initial value: {sorted(local)}")
        model.inv_freq = inverse_frequencies(args.head_dim, args.rope_theta,
                                             args.rope_scaling).to(self.device)
        model.reset_moe_state()

    # --- one step --------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, dim: str = "dp_cp") -> torch.Tensor:
        """Sum `t` over mesh dimension `dim` (in place; returned for chaining)."""
        if self.mesh is not None and self.mesh[dim].size() > 1:
            dist.all_reduce(t, group=self.mesh.group(dim))
        return t

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's part of a batch under context parallelism, with its token positions."""
        cp = self.dims.cp
        if cp == 1:
            return x, y, None
        lb = self.cfg.cp_load_balance
        return (cp_lib.shard_sequence(x, self.cp_rank, cp, lb),
                cp_lib.shard_sequence(y, self.cp_rank, cp, lb),
                cp_lib.local_positions(x.shape[1], self.cp_rank, cp, lb, x.device))

    @contextlib.contextmanager
    def loss_context(self) -> Iterator[None]:
        """Vocabulary-parallel cross-entropy around forward + backward under TP."""
        if self.dims.tp > 1 and self.cfg.loss_parallel:
            with loss_parallel():
                yield
        else:
            yield

    def reduce_loss(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank loss share (or token count) over the ranks that hold different
        tokens (data and context parallel) and pipeline stages (only the last has losses)."""
        self.all_reduce(t, "dp_cp")
        if self.dims.pp > 1:
            self.all_reduce(t, "pp")
        return t
