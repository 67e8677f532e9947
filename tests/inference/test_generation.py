"""KV-cache generation: greedy parity with transformers, cache vs recomputation, sampling."""

from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from scaletrain.inference.generation import filter_logits, generate  # noqa: E402
from scaletrain.models.args import ModelArgs  # noqa: E402
from scaletrain.models.hf import load_hf_checkpoint  # noqa: E402
from scaletrain.models.transformer import build_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 7, 64]


def _hf_llama(**kw):
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               initializer_range=0.15, attn_implementation="eager", bos_token_id=0,
               eos_token_id=None, pad_token_id=0)
    cfg.update(kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def _hf_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                  initializer_range=0.15, bos_token_id=0, eos_token_id=None,
                                  pad_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, our model loaded from its checkpoint)."""
    hf = _hf_llama()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, load_hf_checkpoint(path)[0]


def _hf_greedy(hf, prompt, n, eos=None):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers(pair):
    hf, ours = pair
    new = generate(ours, PROMPT, 40)
    assert len(new) == 40
    assert new == _hf_greedy(hf, PROMPT, 40)


def test_greedy_matches_transformers_gpt2(tmp_path):
    hf = _hf_gpt2()
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_checkpoint(tmp_path)
    assert generate(ours, PROMPT, 30) == _hf_greedy(hf, PROMPT, 30)


def test_stops_after_eos_and_includes_it(pair):
    hf, ours = pair
    full = generate(ours, PROMPT, 30)
    eos = full[10]
    first = full.index(eos)
    new = generate(ours, PROMPT, 30, eos_id=eos)
    assert new == full[: first + 1] and new[-1] == eos
    assert new == _hf_greedy(hf, PROMPT, 30, eos=eos)
    assert generate(ours, PROMPT, 30, eos_id=[eos, 127]) == new  # several eos ids


def test_kv_cache_equals_recomputation(pair):
    _, ours = pair
    new = generate(ours, PROMPT, 25)
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(25):  # no cache: run the whole sequence every step
            seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
        # logits of the cached path, step by step, against one full forward pass
        full = ours(torch.tensor([seq[:-1]]))[0]
        ours.setup_cache(1, len(seq))
        try:
            cached = [ours(torch.tensor([PROMPT]), 0)[0]]
            for pos in range(len(PROMPT), len(seq) - 1):
                cached.append(ours(torch.tensor([[seq[pos]]]), pos)[0])
        finally:
            ours.clear_cache()
    assert new == seq[len(PROMPT):]
    diff = (torch.cat(cached) - full).abs().max().item()
    assert diff <= 1e-5, f"cached vs full-forward logits differ by {diff:.2e}"
    assert all(layer.attention.cache is None for layer in ours.layers.values())


def test_sampling_is_reproducible_with_a_seed(pair):
    _, ours = pair
    a = generate(ours, PROMPT, 30, temperature=1.0, seed=123)
    b = generate(ours, PROMPT, 30, temperature=1.0, seed=123)
    c = generate(ours, PROMPT, 30, temperature=1.0, seed=124)
    assert a == b
    assert a != c
    assert a != generate(ours, PROMPT, 30)  # sampling at T=1 is not greedy here


def test_top_k_1_is_greedy(pair):
    _, ours = pair
    greedy = generate(ours, PROMPT, 20)
    assert generate(ours, PROMPT, 20, temperature=1.5, top_k=1, seed=0) == greedy
    assert generate(ours, PROMPT, 20, temperature=1.5, top_p=1e-6, seed=0) == greedy


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 3
    for k in (1, 5, 50):
        ref = TopKLogitsWarper(k)(None, logits.clone())
        assert torch.equal(filter_logits(logits, top_k=k).isinf(), ref.isinf())
    for p in (0.1, 0.5, 0.9, 0.99):
        ref = TopPLogitsWarper(p)(None, logits.clone())
        assert torch.equal(filter_logits(logits, top_p=p).isinf(), ref.isinf())


def test_sampled_tokens_stay_inside_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0]])
    kept = filter_logits(logits, top_k=2)
    assert kept[0, 1:3].isfinite().all() and kept[0, [0, 3, 4]].isinf().all()


def test_never_exceeds_max_seq_len(pair, caplog):
    _, ours = pair
    prompt = list(range(1, 61))  # max_seq_len is 64
    with caplog.at_level(logging.WARNING, logger="scaletrain.inference.generation"):
        new = generate(ours, prompt, 10)
    assert len(new) == 4 and "max_seq_len" in caplog.text
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(ours, list(range(65)), 1)


def test_bad_arguments_raise():
    model = build_model(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128), seed=0)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 5)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, [1, 500], 5)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [1], 5, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1], 5, temperature=-1.0)
    assert generate(model, [1, 2], 0) == []
