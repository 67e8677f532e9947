"""Fine-tuning building blocks: freezing, LoRA, QLoRA, SFT masking and packing."""

from __future__ import annotations

import pytest
import torch

from scaletrain.finetune.freeze import freeze_layers, param_report
from scaletrain.finetune.lora import (
    LoRAError,
    LoRALinear,
    LoRASettings,
    apply_lora,
    merge_lora,
    parse_targets,
)
from scaletrain.finetune.sft import pack, to_example
from scaletrain.inference.chat import ChatFormatter
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model
from scaletrain.train.loss import IGNORE_INDEX, cross_entropy_sum


def _train(model: torch.nn.Module, steps: int = 3, seed: int = 1) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.args.vocab_size, (4, 16), generator=g)
    losses = []
    for _ in range(steps):
        loss = cross_entropy_sum(model(x[:, :-1]), x[:, 1:]) / x[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_frozen_params_get_no_grad_and_do_not_change(tiny_args: ModelArgs) -> None:
    model = build_model(tiny_args.replace(tie_embeddings=False), seed=0)
    freeze_layers(model, embeddings=True, first=1)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "tok_embeddings.weight" in frozen and "layers.0.attention.wq.weight" in frozen
    assert "layers.1.attention.wq.weight" not in frozen and "output.weight" not in frozen
    before = _snapshot(model)
    params = [p for p in model.parameters() if p.requires_grad]
    x = torch.randint(0, tiny_args.vocab_size, (2, 8))
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n in frozen), n
    model.zero_grad()
    _train(model)
    after = model.state_dict()
    for name in before:
        same = torch.equal(before[name], after[name])
        assert same == (name in frozen), name  # weight decay would move frozen ones too
    assert len(params) < len(list(model.parameters()))


def test_train_last_keeps_only_last_blocks_norm_and_head(tiny_args: ModelArgs) -> None:
    model = build_model(tiny_args.replace(tie_embeddings=False), seed=0)
    freeze_layers(model, embeddings=False, train_last=1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()
                         if n.startswith(("layers.1.", "norm.", "output."))}


def test_lora_starts_as_noop_trains_only_adapters_and_merges(tiny_args: ModelArgs) -> None:
    model = build_model(tiny_args, seed=0)
    x = torch.randint(0, tiny_args.vocab_size, (2, 12))
    with torch.no_grad():
        ref = model(x)
    base_before = _snapshot(model)
    settings = LoRASettings(rank=4, alpha=8, targets=parse_targets("q,v,o,gate,up,down,k"))
    added = apply_lora(model, settings)
    assert len(added) == 7 * tiny_args.n_layers
    with torch.no_grad():
        assert torch.equal(model(x), ref)  # B = 0: exactly the base model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    losses = _train(model, steps=5)
    assert losses[-1] < losses[0]
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:  # base weights live at <module>.base.weight now
            key = name.replace(".base.", ".")
            assert torch.equal(tensor, base_before[key]), name
    with torch.no_grad():
        adapted = model(x)
        assert not torch.allclose(adapted, ref)
        assert merge_lora(model) == len(added)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(x), adapted, atol=1e-5, rtol=1e-5)


def test_lora_targets_that_match_nothing_are_named() -> None:
    with pytest.raises(LoRAError, match="'attn'"):
        parse_targets("q,attn")
    gpt2 = build_model(ModelArgs(arch="gpt2", dim=32, n_layers=1, n_heads=2, vocab_size=64,
                                 max_seq_len=32), seed=0)
    with pytest.raises(LoRAError, match="up"):
        apply_lora(gpt2, LoRASettings(targets=("q", "up")))


def test_qlora_base_within_nf4_error_and_training_lowers_loss(tiny_args: ModelArgs) -> None:
    pytest.importorskip("bitsandbytes")
    from scaletrain.finetune.qlora import BLOCK_SIZE, dequantize, is_nf4, quantize_blocks

    with pytest.raises(ValueError, match="divisible by 64"):  # tiny_args' MLP has 96 rows
        quantize_blocks(build_model(tiny_args, seed=0), torch.float32)
    tiny_args = tiny_args.replace(ffn_dim=128)
    model = build_model(tiny_args, seed=0)
    dense = {n: m.weight.detach().clone() for n, m in model.layers.named_modules()
             if isinstance(m, torch.nn.Linear)}
    assert quantize_blocks(model, torch.float32) == len(dense) == 7 * tiny_args.n_layers
    for name, w in dense.items():
        q = model.layers.get_submodule(name)
        assert is_nf4(q) and q.weight.quant_state.nested  # double quantization
        assert q.weight.numel() * q.weight.element_size() == w.numel() // 2  # 4 bits each
        deq = dequantize(q)
        # Rounding to the nearest of the 16 NF4 levels (in units of the block's absmax) errs by
        # at most half the widest gap between levels; double quantization stores the absmax
        # itself in 8 bits, which adds at most ~1% of the absmax.
        code = q.weight.quant_state.code.float().sort().values
        assert len(code) == 16 and code[0] == -1 and code[-1] == 1
        half_gap = (code[1:] - code[:-1]).max() / 2
        blocks_w = w.flatten().view(-1, BLOCK_SIZE)
        err = (deq.flatten() - w.flatten()).view(-1, BLOCK_SIZE).abs().amax(dim=1)
        bound = blocks_w.abs().amax(dim=1) * (half_gap + 0.01) + 1e-7
        assert bool((err <= bound).all()), name
        assert err.max() > 0  # really quantized
    apply_lora(model, LoRASettings(rank=4, alpha=8))
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    losses = _train(model, steps=8)
    assert losses[-1] < losses[0] - 0.1


class _Tok:
    """A whitespace tokenizer standing in for `tokenizers.Tokenizer` (ids by first sight)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<eos>": 0, "<|user|>": 1, "<|assistant|>": 2}

    def encode(self, text: str, add_special_tokens: bool = True):  # noqa: ANN201
        ids = [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]
        return type("Enc", (), {"ids": ids})()


def test_sft_prompt_tokens_are_not_scored() -> None:
    tok = _Tok()
    fmt = ChatFormatter(tok, eos_id=0)
    ids, mask = fmt.encode({"prompt": "what is two plus two", "response": "four"}, "rec")
    ex = to_example(ids, mask, seq_len=32, where="rec")
    assert ex.inputs == ids[:-1]
    # the default format "user: ...\nassistant: four<eos>\n": only "four" and eos are scored
    words = {v: k for k, v in tok.vocab.items()}
    assert [words[i] for i in ids] == ["user:", "what", "is", "two", "plus", "two",
                                       "assistant:", "four", "<eos>"]
    assert ex.labels == [IGNORE_INDEX] * 6 + [tok.vocab["four"], 0]
    # predict asks exactly what training put before the response
    assert fmt.prompt_ids("what is two plus two") == ids[:7]


def test_sft_chat_template_scores_only_assistant_turns() -> None:
    tok = _Tok()
    template = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} "
                "{% if m.role == 'assistant' %}{{ eos_token }} {% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    fmt = ChatFormatter(tok, eos_id=0, template=template, special_tokens={"eos_token": "<eos>"})
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]
    ids, mask = fmt.encode({"messages": msgs}, "rec")
    words = {v: k for k, v in tok.vocab.items()}
    scored = [words[i] for i, m in zip(ids, mask) if m]
    assert scored == ["hello", "<eos>", "see", "you", "<eos>"]
    assert [words[i] for i in ids][:4] == ["<|user|>", "hi", "there", "<|assistant|>"]
    assert fmt.prompt_ids("bye") == [1, tok.vocab["bye"], 2]


def test_example_longer_than_context_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"data.jsonl:3: the example has 40 tokens.*seq_len=32"):
        to_example(list(range(41)), [True] * 41, seq_len=32, where="data.jsonl:3")


def test_packed_examples_do_not_attend_across_boundaries(tiny_args: ModelArgs) -> None:
    model = build_model(tiny_args, seed=0).eval()
    g = torch.Generator().manual_seed(3)
    a = torch.randint(3, tiny_args.vocab_size, (9,), generator=g).tolist()
    b = torch.randint(3, tiny_args.vocab_size, (6,), generator=g).tolist()
    exs = [to_example(a, [True] * 9, 24, "a"), to_example(b, [True] * 6, 24, "b")]
    rows = pack(exs, seq_len=24, pad_id=0)
    assert len(rows) == 1
    row = rows[0]
    assert row["segment_ids"].tolist() == [0] * 8 + [1] * 5 + [2] * 11
    assert row["labels"][:8].tolist() == a[1:] and row["labels"][13:].eq(IGNORE_INDEX).all()
    with torch.no_grad():
        packed = model(row["tokens"][None], segment_ids=row["segment_ids"][None])[0]
        alone_a = model(torch.tensor([a[:-1]]))[0]
        alone_b = model(torch.tensor([b[:-1]]))[0]
        unmasked = model(row["tokens"][None])[0]
    torch.testing.assert_close(packed[:8], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[8:13], alone_b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked[8:13], alone_b, atol=1e-3)  # the mask is what isolates
    assert len(pack(exs, seq_len=24, pad_id=0, packing=False)) == 2


def test_param_report_counts_4bit_weights_by_logical_size(tiny_args: ModelArgs) -> None:
    pytest.importorskip("bitsandbytes")
    from scaletrain.finetune.qlora import quantize_blocks

    model = build_model(tiny_args.replace(ffn_dim=128), seed=0)
    before = param_report(model)
    in_blocks = sum(m.weight.numel() for m in model.layers.modules()
                    if isinstance(m, torch.nn.Linear))
    quantize_blocks(model, torch.float32)
    after = param_report(model)
    assert after.total == before.total
    assert after.trainable == before.total - in_blocks
    assert after.frozen_bytes == in_blocks // 2


@pytest.mark.parametrize("method,kw", [
    ("full", {}), ("freeze", {"freeze_first": 1}), ("freeze", {"train_last": 1}),
    ("lora", {"rank": 4, "targets": ("q", "v")}), ("lora", {"num_labels": 3}),
    ("lora", {"rank": 4, "train_norms": True}), ("qlora", {"rank": 2}),
    ("freeze", {"freeze_first": 1, "gemma": True}),
    ("lora", {"rank": 2, "train_norms": True, "gemma": True})])
def test_estimate_matches_the_built_model(method: str, kw: dict, tiny_args: ModelArgs) -> None:
    """`gemma`: post-norms and q/k norms (Gemma 2 / Qwen3 block shapes)."""
    from scaletrain.finetune.freeze import train_norms
    from scaletrain.finetune.heads import SequenceClassifier
    from scaletrain.plan.finetune.estimate import estimate

    kw = dict(kw)
    args = tiny_args.replace(ffn_dim=128, tie_embeddings=False)
    if kw.pop("gemma", False):
        args = args.replace(post_norms=True, qk_norm=True)
    model = build_model(args, seed=0)
    if method == "freeze":
        freeze_layers(model, first=kw.get("freeze_first", 0), train_last=kw.get("train_last"))
    if method in ("lora", "qlora"):
        if method == "qlora":
            pytest.importorskip("bitsandbytes")
            from scaletrain.finetune.qlora import quantize_blocks

            quantize_blocks(model, torch.float32)
        apply_lora(model, LoRASettings(rank=kw.get("rank", 8),
                                       targets=kw.get("targets", LoRASettings().targets)))
        if kw.get("train_norms"):
            train_norms(model)
    if "num_labels" in kw:
        model = SequenceClassifier(model, kw["num_labels"])
    est = estimate(args, method, **kw)
    report = param_report(model)
    assert (est.trainable, est.total) == (report.trainable, report.total)
    actual = report.trainable_bytes + report.frozen_bytes
    assert est.weight_bytes == pytest.approx(actual, rel=0.02)


def test_sft_accepts_openai_content_parts() -> None:
    fmt = ChatFormatter(_Tok(), eos_id=0)
    plain = [{"role": "user", "content": "what is two plus two"},
             {"role": "assistant", "content": "four"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "what is "},
                                          {"type": "text", "text": "two plus two"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "four"}]}]
    assert fmt.encode({"messages": parts}, "rec") == fmt.encode({"messages": plain}, "rec")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
             {"role": "assistant", "content": "four"}]
    with pytest.raises(ValueError, match="rec: content part of type 'image_url'"):
        fmt.encode({"messages": image}, "rec")
