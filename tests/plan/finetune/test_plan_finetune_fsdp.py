"""`plan --method` under FSDP holds what the fine-tuning trainer holds: fp32 shards of the
trainable parameters whatever `precision.param_dtype` (FSDP gathers them in 16 bits), and of
the frozen ones in the stored dtype (bf16 with `precision.param_dtype bf16`:
`finetune/frozen_dtype.py`), and with `parallel.cpu_offload` no model state on the device
(`FinetuneTrainer._data_parallel` passes it to `apply_fsdp`)."""

from __future__ import annotations

from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.finetune.estimate import estimate as ft_estimate
from scaletrain.plan.finetune.plan import finetune_plan
from scaletrain.plan.layout import Layout

ARGS = get_preset("llama3.2-1b")
STATES = ("weights", "gradients", "master_weights", "optimizer")


def _layout(param_dtype: str, **kw: object) -> Layout:
    dims = ParallelDims(dp_shard=4)
    return Layout(dims=dims, mbs=1, seq_len=512, zero=3, precision="bf16",
                  param_dtype=param_dtype, recompute="full", **kw)  # type: ignore[arg-type]


def test_fsdp_keeps_bf16_frozen_and_fp32_trainable_shards_for_16_bit_params() -> None:
    want = ft_estimate(ARGS, "lora", rank=16)
    for dtype in ("bf16", "fp32"):
        mem = finetune_plan(estimate(ARGS, _layout(dtype)), "lora", rank=16).memory_bytes
        frozen, trainable = want.total - want.trainable, want.trainable
        if dtype == "bf16":  # the trainable shards are the masters, as in pre-training
            assert mem["weights"] == frozen * 2 // 4
            assert mem["master_weights"] == trainable * 4 // 4
        else:
            assert mem["weights"] == want.total * 4 // 4
            assert mem["master_weights"] == 0
        assert mem["optimizer"] == trainable * 8 // 4


def test_full_fine_tuning_under_fsdp_holds_the_pretraining_states() -> None:
    for dtype in ("bf16", "fp32"):
        pre = estimate(ARGS, _layout(dtype))
        full = finetune_plan(pre, "full").memory_bytes
        for k in STATES:
            assert abs(full[k] - pre.memory_bytes[k]) <= 4, (dtype, k)


def test_fsdp_cpu_offload_moves_every_sharded_state_to_the_host() -> None:
    for method in ("lora", "full"):
        on, off = (finetune_plan(estimate(ARGS, _layout("bf16", cpu_offload=o)), method)
                   for o in (False, True))
        assert all(off.memory_bytes[k] == 0 for k in STATES)
        assert off.cpu_offload_bytes == sum(on.memory_bytes[k] for k in STATES) > 0
        assert off.peak_bytes < on.peak_bytes
    pre = estimate(ARGS, _layout("bf16", cpu_offload=True))
    full = finetune_plan(pre, "full")
    assert abs(full.cpu_offload_bytes - pre.cpu_offload_bytes) <= 16


def test_fsdp_root_unit_stays_gathered_in_the_gather_dtype() -> None:
    """`apply_fsdp` shards the root (embedding, final norm, head) with
    reshard_after_forward=False: gathered from the forward to the backward."""
    from scaletrain.models.args import count_params

    c = count_params(ARGS)
    for dtype, gathered in (("bf16", 2), ("fp32", 4)):
        lay = _layout(dtype, fsdp_param_dtype="fp32")
        plan = finetune_plan(estimate(ARGS, lay), "lora")
        root = c.embedding + c.head + ARGS.dim  # tied: the head is the embedding
        assert plan.memory_bytes["root_gathered"] == root * gathered
    one = estimate(ARGS, Layout(mbs=1, seq_len=512, precision="bf16"))
    assert "root_gathered" not in one.memory_bytes
