"""The generated parity matrix: every option of a training layout as a factor, the combinations
the feasibility function accepts, and a pairwise covering subset of them.

A combination is one value per factor (`FACTORS`). `accepted()` enumerates the full product and
keeps what `scaletrain.parallel.feasibility.layout_problems` accepts on the test model (and
what fits in `MAX_WORLD` processes). `pairwise_cover()` picks, greedily, accepted combinations
until every pair of option values that occurs together in some accepted combination occurs in
a picked one (the AETG-style greedy: each pick covers the most pairs still uncovered; ties go
to fewer processes, then to the earlier combination, so the matrix is the same on every run).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from scaletrain.config import load_config
from scaletrain.models.args import ModelArgs
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.feasibility import SINGLE_STAGE, RunLayout, layout_problems, resolve_mode
from tests.helpers.trainer import tiny_argv

# The test model: 4 layers (pp 2 x 2 virtual stages), 4 heads / 2 KV heads (tp 2), untied.
MODEL = ("--model.n_layers", "4", "--model.tie_embeddings", "false")
# Mixture of Experts on it: 4 experts, top-2, the balancing loss on.
MOE = ("--model.n_experts", "4", "--model.n_experts_per_token", "2", "--model.moe_ffn_dim",
       "64", "--model.moe_aux_loss_coef", "0.01")
SEQ_LEN = 32  # tiny_argv's
MBS = 2  # sequences per micro-batch and data-parallel rank
MAX_WORLD = 8

FACTORS: dict[str, tuple] = {
    # none: one data-parallel rank; hsdp: 2 replicas x 2 shards (ZeRO-3 inside a replica)
    "dp": ("none", "ddp", "zero1", "zero2", "zero3", "hsdp"),
    "tp": ("1", "2-sp", "2-nosp"),
    "pp": ("none", "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
           "ZBVZeroBubble"),
    "cp": (1, 2),
    # moe: the balancing loss per sequence (the default); moe-mb: per micro-batch pooled over
    # the data-parallel ranks (`model.moe_aux_loss_scope micro_batch`); moe-ep2: experts over
    # 2 ranks
    "experts": ("dense", "moe", "moe-mb", "moe-ep2"),
    "precision": ("fp32", "bf16", "fp16"),
    "recompute": ("none", "full", "attention"),
    "fused_loss": (False, True),
    "ga": (1, 2, 4),
}
NAMES = tuple(FACTORS)


@dataclass(frozen=True)
class Combo:
    """One value per factor."""

    values: tuple

    def __getitem__(self, factor: str) -> object:
        return self.values[NAMES.index(factor)]

    @property
    def name(self) -> str:
        return "/".join(f"{k}={v}" for k, v in zip(NAMES, self.values, strict=True))

    @property
    def dims(self) -> ParallelDims:
        dp, tp, pp, cp = self["dp"], self["tp"], self["pp"], self["cp"]
        return ParallelDims(
            pp=1 if pp == "none" else 2, dp_replicate=2 if dp == "hsdp" else 1,
            dp_shard=1 if dp == "none" else 2, cp=int(cp), tp=1 if tp == "1" else 2,
            ep=2 if self["experts"] == "moe-ep2" else 1)

    @property
    def mode_flag(self) -> str:
        """`parallel.data_parallel` as the run is given it."""
        return "auto" if self["dp"] in ("none", "hsdp") else str(self["dp"])

    @property
    def virtual_stages(self) -> int:
        pp = self["pp"]
        return 1 if pp == "none" or pp in SINGLE_STAGE else 2

    @property
    def model_flags(self) -> tuple[str, ...]:
        return model_flags(str(self["experts"]))

    def run_layout(self) -> RunLayout:
        pp = self["pp"]
        return RunLayout(
            dims=self.dims, mode=resolve_mode(self.mode_flag, self.dims), seq_len=SEQ_LEN,
            grad_accum=int(self["ga"]), pp_schedule="1F1B" if pp == "none" else str(pp),
            pp_virtual_stages=self.virtual_stages,
            sequence_parallel=self["tp"] != "2-nosp", precision=str(self["precision"]))

    def argv(self) -> list[str]:
        """The trainer flags of this combination (model, layout and step options)."""
        d = self.dims
        out = ["--parallel.dp_replicate", str(d.dp_replicate), "--parallel.dp_shard",
               str(d.dp_shard), "--parallel.tp", str(d.tp), "--parallel.pp", str(d.pp),
               "--parallel.cp", str(d.cp), "--parallel.ep", str(d.ep),
               "--parallel.data_parallel", self.mode_flag, *self.model_flags,
               "--training.micro_batch_size", str(MBS),
               "--training.grad_accum_steps", str(self["ga"]),
               "--precision.dtype", str(self["precision"])]
        if self["tp"] == "2-nosp":
            out += ["--parallel.sequence_parallel", "false"]
        if self["pp"] != "none":
            out += ["--parallel.pp_schedule", str(self["pp"]),
                    "--parallel.pp_virtual_stages", str(self.virtual_stages)]
        if self["recompute"] == "full":
            out += ["--activation_checkpoint.mode", "full"]
        elif self["recompute"] == "attention":
            out += ["--activation_checkpoint.mode", "partial",
                    "--activation_checkpoint.scope", "attention"]
        if self["fused_loss"]:
            out += ["--training.fused_loss", "true"]
        return out

    def reference_key(self, dtype: str | None = None) -> tuple:
        """The single-process run this one must equal: the same sequences per step (micro-batch
        MBS x dp, the same accumulation), model and precision; no recomputation or fused loss
        (they change no math)."""
        return (MBS * self.dims.dp, int(self["ga"]), self.model_flags,
                dtype or str(self["precision"]))


def model_flags(experts: str) -> tuple[str, ...]:
    """The model of an `experts` value (expert parallelism changes the layout, not the model)."""
    if experts == "dense":
        return MODEL
    scope = "micro_batch" if experts == "moe-mb" else "sequence"
    return (*MODEL, *MOE, "--model.moe_aux_loss_scope", scope)


@cache
def model_args(flags: tuple[str, ...]) -> ModelArgs:
    return load_config(tiny_argv(Path("unused"), Path("unused"), *flags)).model.to_model_args()


def problems(combo: Combo) -> list[str]:
    """Why the trainer refuses `combo` (empty: accepted)."""
    d = combo.dims
    if d.world_size > MAX_WORLD:
        return [f"{d.world_size} processes (the matrix runs at most {MAX_WORLD})"]
    if d.dp_shard % d.ep:
        return ["parallel.ep must divide parallel.dp_shard"]
    return layout_problems(model_args(combo.model_flags), combo.run_layout())


@cache
def accepted() -> tuple[Combo, ...]:
    """Every combination of the full product the feasibility function accepts."""
    return tuple(c for values in itertools.product(*FACTORS.values())
                 if not problems(c := Combo(values)))


def _pair_ids(combos: tuple[Combo, ...]) -> np.ndarray:
    """(combos, factor pairs) ids of the (factor i = a, factor j = b) pair values."""
    index = np.array([[FACTORS[k].index(v) for k, v in zip(NAMES, c.values, strict=True)]
                      for c in combos], dtype=np.int64)
    sizes = [len(v) for v in FACTORS.values()]
    cols, offset = [], 0
    for i, j in itertools.combinations(range(len(NAMES)), 2):
        cols.append(offset + index[:, i] * sizes[j] + index[:, j])
        offset += sizes[i] * sizes[j]
    return np.stack(cols, axis=1)


def pairwise_cover(combos: tuple[Combo, ...]) -> list[Combo]:
    """A subset of `combos` in which every pair of values occurring together in `combos`
    occurs at least once (greedy; fewer processes first among equal gains)."""
    pairs = _pair_ids(combos)
    uncovered = np.zeros(int(pairs.max()) + 1, dtype=bool)
    uncovered[np.unique(pairs)] = True
    world = np.array([c.dims.world_size for c in combos])
    picked: list[Combo] = []
    while uncovered.any():
        gain = uncovered[pairs].sum(axis=1)
        best = gain.max()
        # among the best gains, the fewest processes, then the first
        i = int(np.flatnonzero((gain == best) & (world == world[gain == best].min()))[0])
        picked.append(combos[i])
        uncovered[pairs[i]] = False
    return picked


def covered_pairs(combos: list[Combo] | tuple[Combo, ...]) -> set[tuple]:
    """Every ((factor, value), (factor, value)) pair occurring in `combos`."""
    return {((NAMES[i], c.values[i]), (NAMES[j], c.values[j]))
            for c in combos for i, j in itertools.combinations(range(len(NAMES)), 2)}
