"""Hugging Face <-> scaletrain checkpoints: logits parity both ways, sharding, clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from scaletrain.models.args import PRESETS, ModelArgs, RopeScaling  # noqa: E402
from scaletrain.models.hf import (  # noqa: E402
    hf_config_from_model_args,
    load_hf_checkpoint,
    model_args_from_hf_config,
    save_hf_checkpoint,
)
from scaletrain.models.rope import inverse_frequencies  # noqa: E402
from scaletrain.models.transformer import build_model, empty_model  # noqa: E402

TOL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

LLAMA_CONFIGS = {
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-tied-llama3rope": dict(num_key_value_heads=2, tie_word_embeddings=True,
                                rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
}


def hf_llama(seed: int = 0, **overrides):
    """A tiny random LlamaForCausalLM; a wide init so the logits are O(1), not ~0."""
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, initializer_range=0.15, attn_implementation="eager",
              bos_token_id=0, eos_token_id=1, pad_token_id=None)
    kw.update(overrides)
    if kw.get("rope_scaling"):  # transformers writes rope_theta into the dict it is given
        kw["rope_scaling"] = dict(kw["rope_scaling"])
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()


def hf_gpt2(seed: int = 0):
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=96,
                                  initializer_range=0.15, bos_token_id=0, eos_token_id=1,
                                  attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def tokens(seq: int = 80, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


def max_diff(ours, hf_model, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(x) - hf_model(x).logits).abs().max().item()


# --- Hugging Face -> ours ------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_llama_from_hf_matches_logits(tmp_path, name):
    hf = hf_llama(**LLAMA_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    model, args = load_hf_checkpoint(tmp_path)
    assert args.tie_embeddings == hf.config.tie_word_embeddings
    assert args.kv_heads == hf.config.num_key_value_heads
    x = tokens()  # 80 positions, beyond original_max_position_embeddings=32 of the llama3 rope
    with torch.no_grad():
        scale = hf(x).logits.abs().max().item()
    assert scale > 0.5, "logits too small for the comparison to mean anything"
    diff = max_diff(model, hf, x)
    assert diff <= TOL, f"{name}: max abs logit difference {diff:.2e}"


def test_llama3_rope_scaling_is_applied(tmp_path):
    hf = hf_llama(**LLAMA_CONFIGS["gqa-tied-llama3rope"])
    hf.save_pretrained(tmp_path)
    model, args = load_hf_checkpoint(tmp_path)
    assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    unscaled = empty_model(args.replace(rope_scaling=None))
    unscaled.load_state_dict(model.state_dict())
    x = tokens()
    with torch.no_grad():
        assert (unscaled(x) - model(x)).abs().max() > 1e-3  # so the parity test above has teeth


def test_gpt2_from_hf_matches_logits(tmp_path):
    hf = hf_gpt2()
    hf.save_pretrained(tmp_path)
    model, args = load_hf_checkpoint(tmp_path)
    assert args.arch == "gpt2" and args.max_seq_len == 96 and args.tie_embeddings
    diff = max_diff(model, hf, tokens(seq=96))
    assert diff <= TOL, f"gpt2: max abs logit difference {diff:.2e}"


def test_gpt2_unprefixed_keys_with_attn_buffers(tmp_path):
    """Old GPT-2 checkpoints: no `transformer.` prefix, no lm_head, attn.bias buffers."""
    hf = hf_gpt2()
    hf.save_pretrained(tmp_path / "orig")
    sd = load_file(tmp_path / "orig" / "model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in sd.items() if k != "lm_head.weight"}
    for i in range(2):
        old[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 96, 96))
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "old").mkdir()
    save_file(old, tmp_path / "old" / "model.safetensors")
    (tmp_path / "old" / "config.json").write_text((tmp_path / "orig" / "config.json").read_text())
    model, _ = load_hf_checkpoint(tmp_path / "old")
    assert max_diff(model, hf, tokens()) <= TOL


# --- ours -> Hugging Face ------------------------------------------------------------------
@pytest.mark.parametrize("tie,rope", [(False, None), (True, RopeScaling(8.0, 1.0, 4.0, 32))])
def test_llama_export_loads_in_transformers(tmp_path, tie, rope):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=128, rope_theta=500000.0, rope_scaling=rope, tie_embeddings=tie)
    model = build_model(args, seed=0)
    with torch.no_grad():  # widen the init so the logits are O(1)
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    save_hf_checkpoint(model, tmp_path / "hf", eos_token_id=1)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf",
                                                       attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings == tie
    diff = max_diff(model, hf, tokens())
    assert diff <= TOL, f"max abs logit difference {diff:.2e}"
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["eos_token_id"] == 1
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"


def test_gpt2_export_loads_in_transformers(tmp_path):
    hf = hf_gpt2()
    hf.save_pretrained(tmp_path / "a")
    model, _ = load_hf_checkpoint(tmp_path / "a")
    save_hf_checkpoint(model, tmp_path / "b")
    hf2 = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "b",
                                                       attn_implementation="eager").eval()
    x = tokens()
    with torch.no_grad():
        assert torch.equal(hf2(x).logits, hf(x).logits)


def test_sharded_save_and_load(tmp_path):
    hf = hf_llama(**LLAMA_CONFIGS["gqa-tied-llama3rope"])
    hf.save_pretrained(tmp_path / "src")
    model, _ = load_hf_checkpoint(tmp_path / "src")
    save_hf_checkpoint(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and not (tmp_path / "sharded" / "model.safetensors").exists()
    for shard in shards:
        tensors = load_file(tmp_path / "sharded" / shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 40_000 or len(tensors) == 1
    again, _ = load_hf_checkpoint(tmp_path / "sharded")
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    hf2 = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded",
                                                        attn_implementation="eager").eval()
    assert max_diff(again, hf2, tokens()) <= TOL
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_bf16_load_keeps_float32_rope(tmp_path):
    hf_llama().save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128)
    built = build_model(args, dtype=torch.bfloat16)
    built(torch.zeros(1, 4, dtype=torch.long))  # a cast-rounded table is rebuilt in fp32 on use
    assert built.inv_freq.dtype == torch.float32
    exact = inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    assert torch.equal(built.inv_freq, exact)


# --- errors -------------------------------------------------------------------------------
def test_missing_and_damaged_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    hf_llama().save_pretrained(tmp_path / "ok")
    weights = tmp_path / "ok" / "model.safetensors"

    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((tmp_path / "ok" / "config.json")
                                                        .read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path / "noweights")

    sd = load_file(weights)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "noweights" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor.*layers\.1\.feed_forward\.w3"):
        load_hf_checkpoint(tmp_path / "noweights")

    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is damaged"):
        load_hf_checkpoint(tmp_path / "ok")


def test_missing_shard_is_named(tmp_path):
    model, _ = load_hf_checkpoint(_saved(tmp_path / "src"))
    save_hf_checkpoint(model, tmp_path / "sharded", max_shard_bytes=40_000)
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_hf_checkpoint(tmp_path / "sharded")


def test_save_refuses_existing_directory(tmp_path):
    model = build_model(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128))
    with pytest.raises(FileExistsError):
        save_hf_checkpoint(model, tmp_path)


def _saved(path):
    hf_llama().save_pretrained(path)
    return path


# --- configs ------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["llama3.2-1b", "llama3.1-8b", "llama2-7b", "gpt2-medium"])
def test_config_round_trip(preset):
    args = PRESETS[preset]
    back = model_args_from_hf_config(hf_config_from_model_args(args, torch.bfloat16))
    assert back == args.replace(ffn_dim=args.hidden_dim, multiple_of=back.multiple_of,
                                ffn_dim_multiplier=None)


def test_unsupported_configs_raise_clear_errors():
    cfg = hf_config_from_model_args(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128))
    assert model_args_from_hf_config({**cfg, "head_dim": 32}).head_dim == 32
    with pytest.raises(ValueError, match="yarn"):
        model_args_from_hf_config({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        model_args_from_hf_config({**cfg, "model_type": "falcon"})
    gpt2 = hf_config_from_model_args(PRESETS["gpt2"])
    with pytest.raises(ValueError, match="activation_function"):
        model_args_from_hf_config({**gpt2, "activation_function": "relu"})


def test_transformers5_rope_parameters_are_read():
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                   intermediate_size=96, vocab_size=128, rope_theta=123456.0,
                                   rope_scaling=dict(LLAMA3_ROPE)).to_dict()
    args = model_args_from_hf_config(cfg)
    assert args.rope_theta == 123456.0 and args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)


@pytest.mark.parametrize("theta,rope", [(10000.0, None), (1e6, None), (500000.0, {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192})])
def test_rope_tables_equal_transformers_bit_for_bit_at_128k(theta, rope):
    """Llama-3.2 / Qwen / Llama-2 frequencies at head_dim 128: an ulp off in the frequency
    table is ~1e-2 off in cos/sin near position 128k."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from scaletrain.models.rope import rope_cos_sin

    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_theta=theta,
                                   max_position_embeddings=131072,
                                   rope_scaling=dict(rope) if rope else None)
    args = model_args_from_hf_config(cfg.to_dict())
    ref = LlamaRotaryEmbedding(cfg)
    ours = inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    assert torch.equal(ours, ref.inv_freq)
    pos = torch.arange(131072 - 64, 131072)
    cos, sin = ref(torch.zeros(1, 1, 128), pos[None])
    our_cos, our_sin = rope_cos_sin(ours, pos, torch.float32)
    assert torch.equal(our_cos, cos[0]) and torch.equal(our_sin, sin[0])
