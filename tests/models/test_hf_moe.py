"""Mixtral and Qwen3-MoE against transformers: logits both ways (1e-5 fp32), greedy generation,
exact state-dict round trips (Hub per-expert files and transformers' fused in-memory names),
the CLI, and clear refusals of what scaletrain does not model."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from scaletrain.commands import convert, generate  # noqa: E402
from scaletrain.inference.generation import generate as generate_ids  # noqa: E402
from scaletrain.models.args import PRESETS  # noqa: E402
from scaletrain.models.hf import (  # noqa: E402
    hf_config_from_model_args,
    load_hf_checkpoint,
    model_args_from_hf_config,
    save_hf_checkpoint,
)
from scaletrain.models.hf_state_dict import from_hf_state_dict, to_hf_state_dict  # noqa: E402
from scaletrain.models.transformer import build_model  # noqa: E402
from tests.helpers.family import randomize, tokens  # noqa: E402
from tests.helpers.moe_hf import MOE_FAMILIES, hf_moe_model  # noqa: E402

TOL = 1e-5
NAMES = list(MOE_FAMILIES)


def _diff(ours, hf, x: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        ref = hf(x).logits
        return (ours(x) - ref).abs().max().item(), ref.abs().max().item()


@pytest.mark.parametrize("name", NAMES)
def test_from_hf_logits_and_greedy_generation(tmp_path, name):
    hf = hf_moe_model(name)
    hf.save_pretrained(tmp_path)
    ours, args = load_hf_checkpoint(tmp_path)
    assert args.family == hf.config.model_type and args.n_experts == hf.config.num_experts
    assert args.router_norm_topk == (name != "qwen3_moe_unnormed")
    assert args.sliding_window == hf.config.sliding_window  # 16 for qwen3_moe_unnormed
    diff, scale = _diff(ours, hf, tokens())
    assert scale > 0.5 and diff < TOL, (name, diff, scale)
    prompt = tokens(20, 1)[0].tolist()
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert generate_ids(ours, prompt, 20) == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, name):
    args = model_args_from_hf_config(hf_moe_model(name).config.to_dict())
    ours = build_model(args, seed=0)
    randomize(ours, 3)
    ours.eval()
    save_hf_checkpoint(ours, tmp_path / "hf", bos_token_id=0, eos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    assert hf.config.model_type == args.family
    diff, scale = _diff(ours, hf, tokens())
    assert scale > 0.5 and diff < TOL, (name, diff, scale)
    # transformers' own save writes the same per-expert names we wrote
    hf.save_pretrained(tmp_path / "resaved")
    ours_keys = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert ours_keys == set(load_file(tmp_path / "resaved" / "model.safetensors"))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_state_dict_round_trip_is_exact(tmp_path, name):
    hf = hf_moe_model(name)
    hf.save_pretrained(tmp_path)
    args = model_args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    on_disk = load_file(tmp_path / "model.safetensors")  # the Hub's per-expert layout
    assert any(".experts.3." in k for k in on_disk)
    back = to_hf_state_dict(from_hf_state_dict(on_disk, args), args)
    assert set(back) == set(on_disk)
    assert all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    # transformers' fused in-memory names (gate_up_proj, down_proj) give the same tensors
    memory = {k: v for k, v in hf.state_dict().items()
              if k != "lm_head.weight" or not args.tie_embeddings}
    assert any(k.endswith("experts.gate_up_proj") for k in memory)
    from_memory = from_hf_state_dict(memory, args)
    from_disk = from_hf_state_dict(on_disk, args)
    assert set(from_memory) == set(from_disk)
    assert all(torch.equal(from_memory[k], from_disk[k]) for k in from_disk)


def test_config_round_trip_of_the_presets():
    for name in ("debug-moe", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b"):
        args = PRESETS[name]
        cfg = hf_config_from_model_args(args)
        assert model_args_from_hf_config(cfg) == args, name
        hf_cfg = transformers.AutoConfig.for_model(**cfg)  # transformers accepts every field
        assert hf_cfg.num_experts_per_tok == args.n_experts_per_token


def test_what_scaletrain_does_not_model_is_refused():
    base = hf_moe_model("qwen3_moe").config.to_dict()
    with pytest.raises(ValueError, match="mlp_only_layers"):
        model_args_from_hf_config({**base, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        model_args_from_hf_config({**base, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="shared_expert_gate"):
        model_args_from_hf_config({**base, "model_type": "qwen2_moe"})
    args = model_args_from_hf_config(base)
    with pytest.raises(ValueError, match="sigmoid"):
        hf_config_from_model_args(args.replace(router_score="sigmoid"))
    with pytest.raises(ValueError, match="shared experts"):
        hf_config_from_model_args(args.replace(n_shared_experts=1))
    with pytest.raises(ValueError, match="renormalizes"):
        hf_config_from_model_args(args.replace(family="mixtral", qk_norm=False,
                                               router_norm_topk=False))
    model = build_model(args, seed=0)
    model.layers["1"].feed_forward.router.expert_bias[2] = 0.5
    with pytest.raises(ValueError, match="routing bias"):
        to_hf_state_dict(model.state_dict(), args)


def test_missing_expert_is_named(tmp_path):
    hf = hf_moe_model("mixtral")
    hf.save_pretrained(tmp_path)
    args = model_args_from_hf_config(hf.config.to_dict())
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(KeyError, match="layer 1: expert tensors w3 for experts \\[0, 1, 3\\]"):
        from_hf_state_dict(sd, args)


def test_convert_and_generate_cli(tmp_path, capsys):
    hf = hf_moe_model("qwen3_moe")
    hf.save_pretrained(tmp_path / "hf")
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "native"), "--to", "native"]) == 0
    assert convert.main([str(tmp_path / "native"), str(tmp_path / "back"), "--to", "hf"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager").eval()
    x = tokens()
    with torch.no_grad():
        assert torch.equal(back(x).logits, hf(x).logits)
    capsys.readouterr()
    prompt = [5, 17, 99, 3]
    assert generate.main(["--checkpoint", str(tmp_path / "native"), "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-new-tokens", "8",
                          "--temperature", "0", "--no-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4), max_new_tokens=8,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
    assert json.dumps(ref[0, 4:].tolist()) in json.dumps(out)


# The config.json fields of the published checkpoints (older transformers: top-level rope_theta).
_PUBLISHED = {
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
        router_aux_loss_coef=0.02, output_router_logits=False, tie_word_embeddings=False,
        hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, max_position_embeddings=40960, max_window_layers=48,
        rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, use_sliding_window=False,
        sliding_window=None, attention_bias=False, router_aux_loss_coef=0.001,
        output_router_logits=False, tie_word_embeddings=False, hidden_act="silu"),
}


@pytest.mark.parametrize("name", list(_PUBLISHED))
def test_published_configs_read_as_the_presets(name):
    assert model_args_from_hf_config(_PUBLISHED[name]) == PRESETS[name]
