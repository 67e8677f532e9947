"""Continuous batching (`SlotBatch`), driven step by step so joins are deterministic: a row
that joins a running batch mid-decode, at a shifted cache position, next to rows of other
lengths, budgets and sampling settings, decodes what it decodes alone.

Guaranteed: greedy rows equal `generate` / `decode_rows` of the row alone token for token
(fp32), and transformers' greedy generate on the same converted weights. Seeded sampling
draws from the same per-row generator as `decode_rows` in the same order, so rows equal
`decode_rows` alone as long as float rounding of the logits (batch composition, shifted RoPE
angles) does not move a draw across a token boundary - true here, and asserted.
"""

from __future__ import annotations

import os
from collections import deque

import pytest
import torch

from scaletrain.inference.batch_decode import Row, decode_rows
from scaletrain.inference.generation import generate
from scaletrain.inference.slot_decode import Sampling, SlotBatch, supports
from scaletrain.models.args import ModelArgs, RopeScaling
from scaletrain.models.transformer import build_model

GREEDY = Sampling()


def _sharp(args: ModelArgs):
    m = build_model(args, seed=0)
    with torch.no_grad():  # sharper logits: fewer near-ties in argmax
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(5)
    return m.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model: on a busy 2-core machine two threads ran it up to 70x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return _sharp(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                            max_seq_len=128))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (n,), generator=g).tolist()


def drive(model, items, slots, eos=None, arrive=None, compact_min=64):
    """Run `items` [(Row, Sampling)] through a SlotBatch; item k is offered from step
    `arrive[k]` on (all at once by default), in order. Returns per item: result, the step it
    joined, the step it finished, its slot; the largest occupancy seen, and the batch."""
    arrive = arrive or [0] * len(items)
    batch = SlotBatch(model, slots, eos)
    batch.compact_min = compact_min
    waiting = deque(range(len(items)))
    res, joined, ended, slot = {}, {}, {}, {}
    step = most = 0
    while waiting or batch.occupied:
        while waiting and arrive[waiting[0]] <= step:
            k = waiting[0]
            if not batch.try_join(items[k][0], items[k][1], k):
                break
            waiting.popleft()
            joined[k] = step
            slot[k] = next(i for i, s in enumerate(batch.slots) if s is not None and s.tag == k)
        most = max(most, batch.occupied)
        assert batch.pos <= 2 * model.args.max_seq_len  # cache columns
        assert batch._span() <= model.args.max_seq_len  # the live rows' columns
        for k, r in batch.step():
            assert not isinstance(r, Exception)
            res[k], ended[k] = r, step
        step += 1
        assert step < 1000
    return [res[k] for k in range(len(items))], joined, ended, slot, most, batch


def _mixed_rows(eos_stop_len=3):
    specs = [(3, 3, 12), (40, 4, 30), (9, 5, 5), (17, 6, 20), (1, 7, 25), (60, 8, 9),
             (5, 9, 40), (22, 10, 14)]
    rows = [Row(_prompt(n, s), b, seed=s) for n, s, b in specs]
    rows[2].stop = lambda ids: len(ids) >= eos_stop_len  # a stop callback mid-budget
    return rows


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(1.0, None, 0.9), Sampling(0.8, 20)])
def test_rows_joining_mid_decode_equal_each_row_alone(model, sampling):
    rows = _mixed_rows()
    eos = generate(model, rows[1].prompt, 30)[6]  # row 1 meets it early
    arrive = [0, 0, 0, 2, 5, 5, 11, 30]  # later waves join a running batch
    got, joined, ended, _, most, _ = drive(model, [(r, sampling) for r in rows], 3, eos,
                                           arrive)
    for r, d in zip(rows, got):
        alone = decode_rows(model, [r], *vars(sampling).values(), eos_id=eos)[0]
        assert d.ids == alone.ids and d.finish_reason == alone.finish_reason
        if sampling == GREEDY:
            assert d.ids == generate(model, r.prompt, r.max_new_tokens, eos_id=eos)[:len(d.ids)]
    assert most == 3
    # some rows really joined while others were mid-decode
    assert any(joined[k] > joined[j] and joined[k] < ended[j] for j in ended for k in joined)
    assert got[2].finish_reason == "stop" and len(got[2].ids) == 3


def test_rows_with_different_sampling_settings_share_a_batch(model):
    rows = _mixed_rows()[:6]
    settings = [GREEDY, Sampling(1.0, None, 0.9), Sampling(0.7, 10, None), GREEDY,
                Sampling(1.2, 5, 0.8), Sampling(0.5)]
    got = drive(model, list(zip(rows, settings)), 4, arrive=[0, 0, 1, 1, 3, 7])[0]
    for r, s, d in zip(rows, settings, got):
        assert d.ids == decode_rows(model, [r], *vars(s).values())[0].ids


def test_a_late_row_reuses_the_freed_slot_before_the_long_row_ends(model):
    long, short, late = (Row(_prompt(4, 1), 60), Row(_prompt(10, 2), 3),
                         Row(_prompt(2, 3), 5))
    got, joined, ended, slot, most, _ = drive(model, [(long, GREEDY), (short, GREEDY),
                                                      (late, GREEDY)], 2)
    assert most == 2
    assert joined[2] == ended[1] + 1 and slot[2] == slot[1]  # the freed slot, at once
    assert ended[2] < ended[0]  # finished while the long row still decodes
    for r, d in zip((long, short, late), got):
        assert d.ids == generate(model, r.prompt, r.max_new_tokens)


def test_newcomers_in_scattered_slots_are_prefilled_together(model):
    rows = [Row(_prompt(5, 1), 2), Row(_prompt(8, 2), 25), Row(_prompt(3, 3), 2),
            Row(_prompt(6, 4), 7), Row(_prompt(2, 5), 9)]
    got, joined, _, slot, _, _ = drive(model, [(r, GREEDY) for r in rows], 3)
    assert (slot[3], slot[4]) == (0, 2) and joined[3] == joined[4]  # slot 1 still decodes
    for r, d in zip(rows, got):
        assert d.ids == generate(model, r.prompt, r.max_new_tokens)


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(1.0, None, 0.9)])
def test_compacted_cache_keeps_every_row_equal_to_alone(model, sampling):
    """Rows keep arriving, so the batch never drains: the dead columns are dropped (the live
    ones move left, RoPE positions stay) and the rows still decode what they decode alone."""
    specs = [(n, s, b) for s, (n, b) in enumerate([(4, 30), (7, 9), (2, 14), (5, 22), (3, 6),
                                                   (6, 17), (1, 11), (8, 25), (4, 8), (2, 19),
                                                   (5, 13), (3, 21)])]
    rows = [Row(_prompt(n, s), b, seed=s) for n, s, b in specs]
    got, _, _, _, _, batch = drive(model, [(r, sampling) for r in rows], 3, compact_min=4)
    assert batch.compactions >= 2
    for r, d in zip(rows, got):
        assert d.ids == decode_rows(model, [r], *vars(sampling).values())[0].ids


def test_controls_logprobs_echo_and_budget_zero_as_decode_rows(model):
    p = _prompt(6, 13)
    rows = [Row(_prompt(30, 12), 20),
            Row(p, 4, logprobs=2, echo_logprobs=True),
            Row(p, 5, logit_bias={7: 100.0}),
            Row(p, 8, frequency_penalty=100.0),
            Row(p, 6, presence_penalty=1.5, logit_bias={3: 2.0}, logprobs=0),
            Row(p, 0, logprobs=0, echo_logprobs=True)]
    streamed: list[int] = []
    rows[3].on_token = streamed.append
    got = drive(model, [(r, GREEDY) for r in rows], 3, arrive=[0, 0, 4, 4, 6, 9])[0]
    assert streamed == got[3].ids
    rows[3].on_token = None
    for r, d in zip(rows, got):
        alone = decode_rows(model, [r])[0]
        assert d.ids == alone.ids and d.finish_reason == alone.finish_reason
        assert d.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert [sorted(t) for t in d.top] == [sorted(t) for t in alone.top]
        assert d.prompt_logprobs == pytest.approx(alone.prompt_logprobs, abs=1e-5)
    assert got[2].ids == [7] * 5 and len(set(got[3].ids)) == 8 and got[5].ids == []


def test_admission_makes_room_at_once_and_restarts_when_drained(model):
    batch = SlotBatch(model, 3)
    assert batch.try_join(Row(_prompt(5, 1), 20), GREEDY, "a")
    batch.step()
    assert batch.pos == 6  # decoding: the next token goes to column 6
    # a prompt longer than the column: the live columns move right to make room, at once
    assert batch.try_join(Row(_prompt(10, 2), 4), GREEDY, "long prompt")
    # a budget that runs past the context from here: the cache has twice the context
    assert batch.try_join(Row(_prompt(2, 3), 124), GREEDY, "budget")
    assert not batch.try_join(Row(_prompt(6, 4), 5), GREEDY, "b")  # every slot taken
    out = dict(batch.step())
    assert batch.pos == 11
    while batch.occupied:
        # the cache grows with the columns used, not with the budgets: at most twice them
        assert batch._caches[0].k.shape[2] <= 2 * batch.pos
        out.update(batch.step())
    assert batch.pos == 0 and batch._caches == []  # drained: restarts, memory given back
    for tag, (n, s, b) in {"a": (5, 1, 20), "long prompt": (10, 2, 4),
                           "budget": (2, 3, 124)}.items():
        assert out[tag].ids == generate(model, _prompt(n, s), b)
    with pytest.raises(ValueError, match="empty"):
        batch.try_join(Row([], 3), GREEDY, "bad")


@torch.inference_mode()
def _greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    """The reference: the whole sequence through the model for every new token."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_rows_keep_joining_at_once_for_many_times_the_context(model):
    """A steady stream of rows (each fits the context alone) never waits for the batch to
    drain: the batch runs for more than three times the model's context (128) without
    emptying, every row joins the step it arrives, long prompts included, and decodes what
    plain decoding without a cache gives."""
    specs = [(4 + 9 * (k % 5), 60 + 7 * (k % 3)) for k in range(11)]  # prompt 4..40, 60..74
    rows = [Row(_prompt(n, 100 + k), b) for k, (n, b) in enumerate(specs)]
    arrive = [36 * k for k in range(len(rows))]
    got, joined, ended, _, _, batch = drive(model, [(r, GREEDY) for r in rows], 3,
                                            arrive=arrive)
    assert max(ended.values()) > 3 * model.args.max_seq_len
    assert joined == dict(enumerate(arrive))  # no row waited
    assert all(joined[k + 1] <= ended[k] for k in range(len(rows) - 1))  # never drained
    for r, d in zip(rows, got):
        assert d.ids == _greedy_without_cache(model, r.prompt, r.max_new_tokens)


def test_dropped_rows_free_their_slot(model):
    batch = SlotBatch(model, 2)
    for tag in ("a", "b"):
        assert batch.try_join(Row(_prompt(4, 5), 50), GREEDY, tag)
    for _ in range(3):
        batch.step()
    part = batch.drop("a")
    assert part is not None and len(part.ids) == 3 and batch.occupied == 1
    assert batch.try_join(Row(_prompt(3, 6), 4), GREEDY, "c")
    assert batch.drop("zzz") is None
    out = {}
    while batch.occupied:
        out.update(batch.step())
    assert out["c"].ids == generate(model, _prompt(3, 6), 4)
    assert out["b"].ids == generate(model, _prompt(4, 5), 50)


def test_other_rope_families_sliding_window_softcaps_qk_norm():
    m = _sharp(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                         max_seq_len=96, sliding_window=6, sliding_window_pattern=2,
                         attn_softcap=30.0, final_softcap=20.0, qk_norm=True))
    rows = [Row(_prompt(n, s), b) for n, s, b in [(3, 1, 20), (15, 2, 12), (8, 3, 25),
                                                   (2, 4, 9)]]
    got = drive(m, [(r, GREEDY) for r in rows], 2, arrive=[0, 0, 3, 8], compact_min=4)[0]
    for r, d in zip(rows, got):
        assert d.ids == generate(m, r.prompt, r.max_new_tokens)


def test_absolute_positions_and_longrope_are_not_supported():
    gpt2 = build_model(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=32,
                                 arch="gpt2"), seed=0)
    assert not supports(gpt2)
    with pytest.raises(ValueError, match="relative positions"):
        SlotBatch(gpt2, 2)
    long = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=64,
                     rope_scaling=RopeScaling(kind="longrope", factor=2.0,
                                              original_max_seq_len=32,
                                              short_factor=[1.0] * 8, long_factor=[2.0] * 8))
    assert not supports(build_model(long, seed=0))


os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_greedy_equals_transformers_generate_with_joins(tmp_path):
    transformers = pytest.importorskip("transformers")
    from scaletrain.models.hf import load_hf_checkpoint

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.15, attn_implementation="eager", bos_token_id=0,
        eos_token_id=None, pad_token_id=0)).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)[0]
    rows = [Row(_prompt(n, s), b) for n, s, b in [(7, 1, 30), (3, 2, 8), (12, 3, 20),
                                                   (5, 4, 15), (20, 5, 10)]]
    got = drive(ours, [(r, GREEDY) for r in rows], 2, arrive=[0, 0, 2, 4, 6], compact_min=4)[0]
    for r, d in zip(rows, got):
        out = hf.generate(torch.tensor([r.prompt]), attention_mask=torch.ones(1, len(r.prompt)),
                          max_new_tokens=r.max_new_tokens, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
        assert d.ids == out[0, len(r.prompt):].tolist()
