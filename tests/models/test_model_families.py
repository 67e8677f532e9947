"""Qwen2/2.5, Qwen3, Mistral, Phi-3 and Gemma 2 against transformers: logits both ways, greedy
generation, exact parameter counts of the presets, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.inference.generation import generate, generate_batch  # noqa: E402
from scaletrain.models.args import PRESETS, ModelArgs, count_params  # noqa: E402
from scaletrain.models.hf import (  # noqa: E402
    hf_config_from_model_args,
    load_hf_checkpoint,
    model_args_from_hf_config,
    save_hf_checkpoint,
)
from scaletrain.models.hf_state_dict import from_hf_state_dict, to_hf_state_dict  # noqa: E402
from scaletrain.models.transformer import build_model  # noqa: E402
from tests.helpers.family import COMMON, FAMILIES, hf_model, randomize, tokens  # noqa: E402

TOL = 1e-5
FAMILY_NAMES = list(FAMILIES)


def _diff(ours, hf, x: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        ref = hf(x).logits
        return (ours(x) - ref).abs().max().item(), ref.abs().max().item()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_from_hf_logits_and_greedy_generation(tmp_path, family):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    ours, args = load_hf_checkpoint(tmp_path)
    assert args.family == family
    diff, scale = _diff(ours, hf, tokens())
    assert scale > 0.5, "logits too small for the comparison to mean anything"
    assert diff < TOL, (family, diff)
    prompt = tokens(30, 1)[0].tolist()  # prompt + 30 new tokens pass the sliding windows
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert generate(ours, prompt, 30) == out[0, len(prompt):].tolist()
    # A left-padded batch of different prompt lengths, as transformers batches them (its
    # positions restart at each row's first token; ours count the padding, RoPE is relative).
    prompts = [prompt, tokens(12, 2)[1].tolist(), tokens(5, 1)[0].tolist()[::-1]]
    ids = torch.zeros(3, len(prompt), dtype=torch.long)
    mask = torch.zeros(3, len(prompt), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, len(prompt) - len(p):], mask[i, len(prompt) - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        real = mask.bool()
        diff = (ours(ids, key_mask=real) - hf(ids, attention_mask=mask).logits)[real]
        assert diff.abs().max() < TOL
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    assert generate_batch(ours, prompts, 30) == out[:, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, family):
    args = model_args_from_hf_config(hf_model(family).config.to_dict())
    ours = build_model(args, seed=0)
    randomize(ours, 3, unit_offset=args.norm_unit_offset)
    ours.eval()
    save_hf_checkpoint(ours, tmp_path / "hf", bos_token_id=0, eos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    assert hf.config.model_type == family
    diff, scale = _diff(ours, hf, tokens())
    assert scale > 0.5 and diff < TOL, (family, diff, scale)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_state_dict_round_trip_is_exact(family):
    hf = hf_model(family)
    args = model_args_from_hf_config(hf.config.to_dict())
    hf_sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"
             or not args.tie_embeddings}
    back = to_hf_state_dict(from_hf_state_dict(hf_sd, args), args)
    assert set(back) == set(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def _hf_param_count(args: ModelArgs) -> int:
    cfg = transformers.AutoConfig.for_model(**hf_config_from_model_args(args))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


# The totals the model cards / safetensors headers publish (tied heads counted once).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
             "qwen2.5-7b": 7_615_616_512, "qwen3-0.6b": 596_049_920,
             "qwen3-8b": 8_190_735_360, "mistral-7b-v0.3": 7_248_023_552,
             "phi3-mini": 3_821_079_552, "gemma-2b": 2_506_172_416,
             "gemma-7b": 8_537_680_896, "gemma2-2b": 2_614_341_888,
             "gemma2-9b": 9_241_705_984}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts(name):
    args = PRESETS[name]
    assert count_params(args).total == PUBLISHED[name]
    assert _hf_param_count(args) == PUBLISHED[name]  # transformers' model of our config.json


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_built_model_matches_count_params(family):
    args = PRESETS[f"debug-{family}"]
    model = build_model(args, seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_params(args).total


def test_unsupported_model_type_lists_the_supported_ones():
    cfg = hf_config_from_model_args(PRESETS["debug-qwen2"])
    with pytest.raises(ValueError, match="'falcon'.*'qwen3'.*'gemma2'"):
        model_args_from_hf_config({**cfg, "model_type": "falcon"})
    with pytest.raises(ValueError, match="layer_types"):
        model_args_from_hf_config({**hf_config_from_model_args(PRESETS["debug-gemma2"]),
                                   "layer_types": ["sliding_attention", "full_attention",
                                                   "full_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match="cannot hold"):
        hf_config_from_model_args(PRESETS["debug-qwen2"].replace(family="mistral"))
    for family in ("gemma", "gemma2", "phi3"):  # a bias transformers would add is refused
        with pytest.raises(ValueError, match="attention_bias"):
            model_args_from_hf_config({**hf_config_from_model_args(PRESETS[f"debug-{family}"]),
                                       "attention_bias": True})
    gemma = hf_config_from_model_args(PRESETS["debug-gemma"])  # Gemma 1 releases say "gelu"
    assert model_args_from_hf_config({**gemma, "hidden_act": "gelu"}).mlp_act == "gelu_tanh"


def _write_tokenizer(directory, template: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(126)} | {"<s>": 126, "</s>": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(directory)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_convert_hf_to_native_and_back_carries_weights_and_chat_template(tmp_path, family):
    from scaletrain.commands import convert as convert_cmd

    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    _write_tokenizer(tmp_path / "hf", template)
    assert convert_cmd.main([str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "hf"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    x = tokens()
    with torch.no_grad():
        assert torch.equal(back(x).logits, hf(x).logits)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.chat_template == template


def test_phi3_longrope_matches_transformers_both_ways(tmp_path):
    g = torch.Generator().manual_seed(5)
    rope = {"rope_type": "longrope", "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
            "long_factor": (1 + 4 * torch.rand(8, generator=g)).tolist()}
    cfg = transformers.Phi3Config(**{**COMMON, "num_key_value_heads": 4, "rope_scaling": rope,
                                     "max_position_embeddings": 256,
                                     "original_max_position_embeddings": 64})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize(hf, 0)
    hf.eval().save_pretrained(tmp_path / "hf")
    ours, args = load_hf_checkpoint(tmp_path / "hf")
    assert args.rope_scaling.kind == "longrope" and args.rope_scaling.attention_factor > 1
    assert ModelArgs.from_dict(json.loads(json.dumps(args.to_dict()))) == args  # meta.json
    for seq in (40, 80):  # short factors within the original 64 positions, long beyond
        diff, scale = _diff(ours, hf, tokens(seq))
        assert scale > 0.5 and diff < TOL, (seq, diff)
    prompt = tokens(50, 1)[0].tolist()  # decoding crosses position 64: the factors switch
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert generate(ours, prompt, 30) == out[0, len(prompt):].tolist()
    save_hf_checkpoint(ours, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager").eval()
    diff, _ = _diff(ours, back, tokens(80))
    assert diff < TOL
    from scaletrain.inference.generation import generate_batch

    assert generate_batch(ours, [prompt, prompt[5:]], 30)[0] == out[0, len(prompt):].tolist()


def test_serve_answers_with_a_gemma2_checkpoint(tmp_path):
    """The OpenAI endpoint over a Hugging Face Gemma 2 directory: its greedy completion is
    transformers' greedy continuation."""
    import threading
    import urllib.request

    from scaletrain.commands.serve import make_server
    from scaletrain.inference.generators import LocalGenerator

    hf = hf_model("gemma2")
    hf.save_pretrained(tmp_path / "hf")
    _write_tokenizer(tmp_path / "hf", "{{ messages }}")
    server = make_server(LocalGenerator.from_checkpoint(tmp_path / "hf"), "127.0.0.1", 0, "g2")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        prompt = " ".join(f"w{i}" for i in (5, 17, 42, 99, 3, 60, 7, 8, 11, 30))
        body = json.dumps({"model": "g2", "prompt": prompt, "max_tokens": 20,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://{host}:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
    finally:
        server.shutdown()
        server.server_close()
        server.engine.close()
    ids = [int(w[1:]) for w in prompt.split()]
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                      max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=1)
    expected = " ".join(f"w{i}" if i < 126 else "" for i in out[0, len(ids):].tolist())
    assert text.split() == expected.split()


def test_gemma2_with_other_layer_types_converts_both_ways(tmp_path):
    """Gemma 2 configs name each layer's attention (`layer_types`); a layout other than the
    default alternation loads and is written back the same way."""
    cls_name, extra = FAMILIES["gemma2"]
    cfg = transformers.Gemma2Config(**{**COMMON, **extra,
                                       "layer_types": ["sliding_attention"] * 3})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize(hf, 0, unit_offset=True)
    hf.eval().save_pretrained(tmp_path / "hf")
    ours, args = load_hf_checkpoint(tmp_path / "hf")
    assert args.sliding_window_pattern == 1
    save_hf_checkpoint(ours, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager").eval()
    assert back.config.layer_types == ["sliding_attention"] * 3
    for model in (hf, back):
        diff, scale = _diff(ours, model, tokens())
        assert scale > 0.5 and diff < TOL
