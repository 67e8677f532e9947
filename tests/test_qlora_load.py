"""QLoRA's layer-by-layer load on one process (`finetune/qlora_load.py`), against the model one
QLoRA process builds from the whole fp32 base (bitsandbytes layers, made shardable): the same
NF4 bytes, code books, other parameters and logits, from a Hugging Face base and from a native
checkpoint; the empty model reports the same parameter counts and memory; a layer bitsandbytes
cannot quantize on the CPU is refused before anything is read."""

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
from scaletrain.finetune.qlora_shard import shardable_nf4  # noqa: E402
from scaletrain.models.args import ModelArgs  # noqa: E402
from scaletrain.models.transformer import Transformer  # noqa: E402

ARGS = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)


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

    dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=64, tie_word_embeddings=False)
    base = make_base(tmp_path / "hf", dims, "1MB", torch.bfloat16)
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
