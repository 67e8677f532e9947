"""QLoRA's layer-by-layer load on one process (`finetune/qlora_load.py`), against the model one
QLoRA process builds from the whole fp32 base (bitsandbytes layers, made shardable): the same
NF4 bytes, code books, other parameters and logits, from a Hugging Face base and from a native
checkpoint; the empty model reports the same parameter counts and memory; a layer bitsandbytes
cannot quantize on the CPU is refused before anything is read.

One process's own path (the trainer without torchrun: filled before the adapters are made,
then bitsandbytes `Linear4bit` layers) equals quantizing the whole fp32 base in every tensor,
quantization state, attribute, logit and adapter gradient, and its peak host RSS, measured in a
fresh process, is what `plan --method qlora` states (plus a margin), not the fp32 base."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("bitsandbytes")

from scaletrain.finetune.freeze import memory_report, param_report  # noqa: E402
from scaletrain.finetune.lora import LoRASettings  # noqa: E402
from scaletrain.finetune.methods import apply_method  # noqa: E402
from scaletrain.finetune.qlora_load import empty_nf4, materialize_qlora  # noqa: E402
from scaletrain.finetune.qlora_shard import NF4Linear, shardable_nf4  # noqa: E402
from scaletrain.models.args import ModelArgs  # noqa: E402
from scaletrain.models.transformer import Transformer  # noqa: E402

ARGS = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)
HF_DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
               tie_word_embeddings=False)


def _qlora(model: Transformer) -> Transformer:
    apply_method(model, "qlora", lora=LoRASettings(rank=4), quant_dtype=torch.float32, seed=3)
    return model


def _reference(args: ModelArgs, weights: dict[str, torch.Tensor]) -> Transformer:
    model = Transformer(args)
    model.load_state_dict(weights)
    model = _qlora(model)
    shardable_nf4(model)
    return model


def _same(model: nn.Module, ref: nn.Module) -> list[str]:
    expected = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    got = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert got.keys() == expected.keys()
    return [n for n, t in got.items() if not torch.equal(t, expected[n])]


def _loaded(directory: Path, args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    _qlora(model)
    report = materialize_qlora(model, model, SimpleNamespace(directory=directory, args=args),
                               torch.device("cpu"))
    assert report.bytes_read > 0
    return model


def test_hf_base_quantized_layer_by_layer_equals_one_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from bench.finetune_load_cpu import make_base
    from scaletrain.models.hf import hf_model_args, load_hf_checkpoint

    base = make_base(tmp_path / "hf", HF_DIMS, "1MB", torch.bfloat16)
    args = hf_model_args(base)
    ref = _reference(args, load_hf_checkpoint(base, dtype=torch.float32)[0].state_dict())
    model = _loaded(base, args)
    assert _same(model, ref) == []
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))


def test_native_base_quantized_layer_by_layer_equals_one_process(tmp_path: Path) -> None:
    from scaletrain.checkpoint.native_format import save_model_checkpoint

    torch.manual_seed(0)
    whole = Transformer(ARGS)
    save_model_checkpoint(whole, ARGS, tmp_path / "native")
    ref = _reference(ARGS, whole.state_dict())
    assert _same(_loaded(tmp_path / "native", ARGS), ref) == []


def test_the_empty_model_reports_what_one_process_holds() -> None:
    torch.manual_seed(0)
    ref = _qlora(Transformer(ARGS))  # bitsandbytes layers
    with torch.device("meta"):
        empty = Transformer(ARGS)
    _qlora(empty)
    assert param_report(empty) == param_report(ref)
    assert memory_report(empty) == memory_report(ref)
    # the adapters are made for real from the seed, as in one process
    adapters = {n: p for n, p in empty.named_parameters() if p.requires_grad}
    assert adapters and all(torch.equal(p, dict(ref.named_parameters())[n])
                            for n, p in adapters.items())


def test_a_row_bitsandbytes_cannot_quantize_on_cpu_is_refused_before_reading() -> None:
    with torch.device("meta"):
        linear = nn.Linear(96, 64, bias=False)
    with pytest.raises(ValueError, match="divisible by 64"):
        empty_nf4(linear, torch.float32)


def _state(module: nn.Module) -> dict[str, object]:
    """A module's plain attributes (settings, not submodules or tensors)."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "quant_state" and k != "module"}


def _quant_fields(state: object) -> dict[str, object]:
    return {k: v for k, v in vars(state).items() if k != "state2"}


def _same_field(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_one_process_load_equals_quantizing_the_whole_base(tmp_path: Path,
                                                           compute: torch.dtype) -> None:
    """The trainer's one-process QLoRA (`apply_method(load_quantized=...)`): bitsandbytes
    layers equal in everything to those `to_nf4` makes from the whole fp32 base."""
    pytest.importorskip("transformers")
    from bench.finetune_load_cpu import make_base
    from scaletrain.models.hf import hf_model_args, load_hf_checkpoint

    base = make_base(tmp_path / "hf", HF_DIMS, "1MB", torch.bfloat16)
    args = hf_model_args(base)
    settings = dict(lora=LoRASettings(rank=4), quant_dtype=compute, seed=3)
    ref = load_hf_checkpoint(base, dtype=torch.float32)[0]
    apply_method(ref, "qlora", **settings)
    with torch.device("meta"):
        model = Transformer(args)
    reports = []
    apply_method(model, "qlora", **settings, load_quantized=lambda meta: reports.append(
        materialize_qlora(meta, meta, SimpleNamespace(directory=base, args=args),
                          torch.device("cpu"), bitsandbytes=True)))
    assert len(reports) == 1 and reports[0].bytes_read > 0
    assert not any(isinstance(m, NF4Linear) for m in model.modules())
    modules, expected = dict(model.named_modules()), dict(ref.named_modules())
    assert {n: type(m) for n, m in modules.items()} == {n: type(m) for n, m in expected.items()}
    quantized = [n for n, m in expected.items() if type(m).__name__ == "Linear4bit"]
    assert len(quantized) == 7 * args.n_layers
    for name in quantized:
        got, want = modules[name], expected[name]
        assert _state(got) == _state(want) and _state(got.weight) == _state(want.weight), name
        for a, b in ((got.weight.quant_state, want.weight.quant_state),
                     (got.weight.quant_state.state2, want.weight.quant_state.state2)):
            fields, ref_fields = _quant_fields(a), _quant_fields(b)
            assert fields.keys() == ref_fields.keys(), name
            assert all(_same_field(v, ref_fields[k]) for k, v in fields.items()), name
    # every tensor, the quantization state bitsandbytes serializes included
    got_sd, want_sd = model.state_dict(), ref.state_dict()
    assert got_sd.keys() == want_sd.keys()
    assert [k for k, v in got_sd.items() if not _same_field(v, want_sd[k])] == []
    assert _same(model, ref) == []
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for m in (model, ref):
        m(tokens).float().square().mean().backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads and all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters()
                         if p.requires_grad)


# Allocator retention: glibc keeps heap memory freed between layers instead of returning it
# (measured here: 5-15 MiB over the plan); bounded, so it does not grow with the model.
RSS_MARGIN = 32 * 2**20
RSS_DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                max_position_embeddings=256, tie_word_embeddings=False)  # 104 MiB in fp32


def test_one_process_peak_rss_is_the_4bit_base_not_the_fp32_base(tmp_path: Path) -> None:
    """Measured in a fresh process (`bench/qlora_load_cpu.py`'s one-process load: `VmHWM`
    over the RSS before loading, bitsandbytes imported first): at least the 4-bit base the
    planner states and at most its peak plus a margin, which is below the fp32 base the one
    process read before (measured here: 41 MiB against a plan of 26 MiB and a 104 MiB fp32
    base; the whole-base path rose by 124 MiB)."""
    pytest.importorskip("transformers")
    from bench.finetune_load_cpu import base_sizes, make_base
    from bench.qlora_load_cpu import run
    from scaletrain.models.hf import hf_model_args
    from scaletrain.plan.finetune.host import host_load_bytes

    base = make_base(tmp_path / "hf", RSS_DIMS, "30MB", torch.bfloat16)
    plan = host_load_bytes(hf_model_args(base), "qlora", 1, 2)
    fp32 = base_sizes(base, torch.float32)["base_bytes"]
    [got] = run(base, 1, "one")
    what = (got["peak_rise"] / 2**20, plan["weights"] / 2**20, plan["peak"] / 2**20)
    assert got["bytes_read"] == fp32 // 2  # the whole base read once, in its stored bf16
    assert plan["weights"] <= got["peak_rise"] <= plan["peak"] + RSS_MARGIN, what
    assert plan["peak"] + RSS_MARGIN < fp32, (what, fp32 / 2**20)  # the bound tells the two
