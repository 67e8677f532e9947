"""Regions of our tensors read straight from Hugging Face safetensors (`models.hf_slices`)
equal the same regions of the whole converted checkpoint, bit for bit, for a plain rename
(Llama), a fused projection split along its rows (Phi-3's qkv_proj / gate_up_proj) and a
transposed, fused GPT-2 Conv1D, and the experts of Mixtral / Qwen3-MoE stored one tensor per
expert and stacked into ours; every such tensor is read as a slice (no whole-file fallback), and
the bytes read are those of the region (a range of experts: those experts' slices only)."""

from __future__ import annotations

import pytest
import torch

from scaletrain.checkpoint import sharded_load
from scaletrain.models.hf import hf_model_args, hf_slices
from scaletrain.models.hf_files import read_hf_weights
from scaletrain.models.hf_state_dict import from_hf_state_dict
from tests.helpers.family import hf_model
from tests.helpers.moe_hf import hf_moe_model

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                  n_positions=96, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _regions(shape: tuple[int, ...], g: torch.Generator) -> list[tuple[slice, ...]]:
    """The whole tensor, a block of rows, a block of columns, and a random box."""
    def cut(n: int) -> slice:
        a = int(torch.randint(0, n, (1,), generator=g))
        return slice(a, int(torch.randint(a + 1, n + 1, (1,), generator=g)))

    whole = tuple(slice(0, n) for n in shape)
    out = [whole, tuple(cut(n) for n in shape)]
    if len(shape) == 2:
        out += [(cut(shape[0]), slice(0, shape[1])), (slice(0, shape[0]), cut(shape[1]))]
    return out


def _saved(tmp_path, family):
    if family == "gpt2":
        model = _gpt2()
    elif family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    elif family in ("mixtral", "qwen3_moe"):
        model = hf_moe_model(family)
    else:
        model = hf_model(family)
    model.save_pretrained(tmp_path, max_shard_size="40KB")


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2", "mixtral", "qwen3_moe"])
def test_regions_equal_the_whole_conversion(tmp_path, family):
    _saved(tmp_path, family)
    args = hf_model_args(tmp_path)
    whole = from_hf_state_dict(read_hf_weights(tmp_path), args)
    g = torch.Generator().manual_seed(0)
    # The converter makes the MoE routing biases (zeros; no stored tensor holds them).
    made = {n for n in whole if n.endswith("router.expert_bias")}
    with hf_slices(tmp_path, args) as reader:
        assert set(reader.shapes) == set(whole)
        assert all(v is not None for n, v in reader.views.items() if n not in made), reader.views
        for name, full in whole.items():
            if name in made:
                continue
            for region in _regions(tuple(full.shape), g):
                before = reader.bytes_read
                got = reader.read(name, region, torch.float32)
                assert torch.equal(got, full[region].float()), (name, region)
                assert reader.bytes_read - before == full[region].numel() * full.element_size()
        # a dtype cast on the way
        name = next(iter(whole))
        assert reader.read(name, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["gpt2", "mixtral"])
def test_fill_regions_reads_in_blocks_of_rows(tmp_path, family, monkeypatch):
    """`fill_regions` reads a region in blocks of dim-0 rows of at most READ_BLOCK_BYTES (in
    the target's dtype): every tensor ends up equal to the whole conversion, no read exceeds
    the block (or one row), and the bytes read are the tensors' (a transposed Conv1D, stacked
    experts)."""
    _saved(tmp_path, family)
    args = hf_model_args(tmp_path)
    whole = from_hf_state_dict(read_hf_weights(tmp_path), args)
    limit = 1024
    monkeypatch.setattr(sharded_load, "READ_BLOCK_BYTES", limit)
    names = [n for n in whole if not n.endswith("router.expert_bias")]
    targets = {n: torch.empty(whole[n].shape) for n in names}
    biggest = []
    with hf_slices(tmp_path, args) as reader:
        def read(name, region, dtype):
            got = reader.read(name, region, dtype)
            row = got[0].numel() * got.element_size() if got.dim() else got.element_size()
            biggest.append(got.numel() * got.element_size() > max(limit, row))
            return got

        sharded_load.fill_regions(targets, read)
        assert reader.bytes_read == sum(whole[n].numel() * whole[n].element_size()
                                        for n in names)
    assert len(biggest) > len(names) and not any(biggest)
    for n in names:
        assert torch.equal(targets[n], whole[n].float()), n
