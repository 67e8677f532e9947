"""Batched decoding: a row's output does not depend on its batch-mates (lengths, budgets,
stops), stop callbacks end decoding, log-probabilities equal a full forward pass."""

from __future__ import annotations

import pytest
import torch

from scaletrain.inference.batch_decode import Row, decode_rows
from scaletrain.inference.generation import generate, generate_batch
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model


@pytest.fixture(scope="module")
def model():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                     max_seq_len=128)
    m = build_model(args, seed=0)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(5)
    return m.eval()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (n,), generator=g).tolist()


def test_each_row_keeps_its_budget_next_to_a_long_prompt(model):
    short, long = _prompt(5, 1), _prompt(100, 2)
    alone = generate(model, short, 64)
    assert len(alone) == 64
    both = generate_batch(model, [short, long], 64)  # the long prompt has room for 28 only
    assert both[0] == alone
    assert len(both[1]) == 28 and both[1] == generate(model, long, 28)


def test_same_output_alone_and_batched_with_mixed_lengths_budgets_and_stops(model):
    prompts = [_prompt(n, s) for n, s in [(3, 3), (17, 4), (9, 5), (40, 6), (1, 7)]]
    budgets = [12, 30, 5, 20, 25]
    eos = generate(model, prompts[1], 30)[6]  # row 1 meets it after 7 tokens at the latest
    stop_after = {2: 3}  # row 2: a stop callback that fires after 3 tokens
    calls: list[int] = []

    def rows():
        out = []
        for i, (p, b) in enumerate(zip(prompts, budgets)):
            stop = (lambda ids, n=stop_after[i]: len(ids) >= n) if i in stop_after else None
            out.append(Row(p, b, seed=i, stop=stop, on_token=calls.append))
        return out

    for temperature in (0.0, 1.0):
        calls.clear()
        batched = decode_rows(model, rows(), temperature, top_p=0.9, eos_id=eos)
        alone = [decode_rows(model, [r], temperature, top_p=0.9, eos_id=eos)[0] for r in rows()]
        assert [d.ids for d in batched] == [d.ids for d in alone]
        assert [d.finish_reason for d in batched] == [d.finish_reason for d in alone]
        assert len(batched[2].ids) == 3 and batched[2].finish_reason == "stop"
        assert batched[1].ids[-1] == eos or temperature > 0
        for d, b in zip(batched, budgets):
            assert len(d.ids) <= b and (d.finish_reason == "stop" or len(d.ids) == b)
        assert len(calls) == 2 * sum(len(d.ids) for d in batched)  # streamed once per token


def test_stop_ends_decoding_instead_of_cutting_text(model):
    steps = []
    orig = model.forward

    def counting(*a, **k):
        steps.append(1)
        return orig(*a, **k)

    model.forward = counting
    try:
        decode_rows(model, [Row(_prompt(4, 9), 50, stop=lambda ids: len(ids) == 2)])
    finally:
        del model.forward
    assert len(steps) == 1  # one step after the prefill, then the row stopped


def test_logprobs_equal_a_full_forward(model):
    prompt = _prompt(10, 11)
    d = decode_rows(model, [Row(_prompt(30, 12), 3), Row(prompt, 4, logprobs=2,
                                                            echo_logprobs=True)])[1]
    full = prompt + d.ids
    with torch.no_grad():
        logp = model(torch.tensor([full]))[0].float().log_softmax(-1)
    want = [float(logp[i, full[i + 1]]) for i in range(len(full) - 1)]
    got = d.prompt_logprobs[1:] + d.logprobs
    assert d.prompt_logprobs[0] is None
    assert got == pytest.approx(want, abs=1e-4)
    assert all(len(t) == 2 for t in d.top) and all(max(t.values()) >= lp for t, lp in
                                                       zip(d.top, d.logprobs))


def test_budget_zero_and_logit_bias(model):
    p = _prompt(6, 13)
    d = decode_rows(model, [Row(p, 0, logprobs=0, echo_logprobs=True)])[0]
    assert d.ids == [] and len(d.prompt_logprobs) == 6
    forced = decode_rows(model, [Row(p, 5, logit_bias={7: 100.0})])[0]
    assert forced.ids == [7] * 5
    rep = decode_rows(model, [Row(p, 8, frequency_penalty=100.0)])[0]
    assert len(set(rep.ids)) == 8  # a large frequency penalty forbids repeats
