"""Multi-turn SFT: the token ids and loss mask of a `messages` record equal TRL's
(`SFTTrainer` with `assistant_only_loss=True`: its training template for the model's template,
`apply_chat_template(..., return_assistant_tokens_mask=True)`), for Qwen3's and Phi-3's
published templates, whose renders are not a growing prefix. With the template's own
`{% generation %}` blocks the mask is those blocks.

TRL is not a dependency: install it into a folder of its own and point SCALETRAIN_REF_PATH at
it (`pip install --no-deps --target DIR trl`); without it the TRL comparison is skipped."""

from __future__ import annotations

import os
import sys

import pytest

from scaletrain.inference.chat import ChatFormatter
from scaletrain.inference.loader import read_chat_template
from tests.inference.test_chat_templates import TEMPLATES, tokenizer_dir

transformers = pytest.importorskip("transformers")

RECORDS = [
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "<think>\nthey asked\n</think>\n\nBecause."},
     {"role": "user", "content": "Sure?"},
     {"role": "assistant", "content": "<think>\ncheck\n</think>\n\nYes."},
     {"role": "user", "content": "Ok."}, {"role": "assistant", "content": "Bye."}],
]


def _trl():
    ref = os.environ.get("SCALETRAIN_REF_PATH")
    if ref and ref not in sys.path:
        sys.path.insert(0, ref)
    try:
        from trl.chat_template_utils import get_training_chat_template
        from trl.data_utils import _tokenize
    except ImportError:
        pytest.skip("TRL is not installed (set SCALETRAIN_REF_PATH to a folder holding it)")
    return get_training_chat_template, _tokenize


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
@pytest.mark.parametrize("record", range(len(RECORDS)))
def test_multi_turn_masks_equal_trl(tmp_path, family, record):
    get_training_chat_template, trl_tokenize = _trl()
    d = tokenizer_dir(tmp_path, family)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    training = get_training_chat_template(tok)
    assert training is not None  # TRL recognised the published template
    messages = RECORDS[record]
    out = trl_tokenize(tok, messages, return_assistant_tokens_mask=True, chat_template=training,
                       tools=None)
    want_ids, want_mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    template, special = read_chat_template(d)
    for source in (template, training):  # render-and-diff, and TRL's generation blocks
        fmt = ChatFormatter(tok.backend_tokenizer, tok.eos_token_id, source, special)
        ids, mask = fmt.encode({"messages": [dict(m) for m in messages]}, "rec")
        assert ids == want_ids
        assert mask == want_mask
    assert sum(want_mask) > 0


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_every_assistant_turn_is_scored_as_generated(tmp_path, family):
    """Without TRL: each assistant turn's scored text is what the model produces when asked
    for that turn (its generation prompt + the scored text = the render of the conversation
    up to that turn), and the prompt tokens of the first turn are serve's prompt tokens."""
    d = tokenizer_dir(tmp_path, family)
    template, special = read_chat_template(d)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    fmt = ChatFormatter(tok.backend_tokenizer, tok.eos_token_id, template, special)
    messages = RECORDS[1]
    ids, mask = fmt.encode({"messages": [dict(m) for m in messages]}, "rec")
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(runs) == len(turns)
    for i, run in zip(turns, runs):
        text = tok.decode(run)
        prompt = fmt.render(messages[:i], True)
        assert (prompt + text) == fmt.render(messages[: i + 1], False)[: len(prompt + text)]
        content = messages[i]["content"].split("</think>")[-1].strip()
        assert content in text
    assert ids[: mask.index(True)] == fmt.conversation_prompt_ids(messages[:turns[0]])
    assert (TEMPLATES / f"{family}.jinja").is_file()


def test_a_template_whose_turns_drop_their_generation_prompt_trains_as_rendered(tmp_path,
                                                                               caplog):
    """DeepSeek-R1's template (published as DeepSeek-V3's too) prefills `<think>\\n` in the
    generation prompt but renders every turn without it (and without earlier reasoning):
    each turn is trained as transformers renders the whole conversation, the text after each
    `<｜Assistant｜>` header up to the next user turn, and the fallback is said once."""
    d = tokenizer_dir(tmp_path, "deepseekv3")
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    fmt = ChatFormatter(tok.backend_tokenizer, tok.eos_token_id, *read_chat_template(d))
    with caplog.at_level("WARNING", logger="scaletrain.inference.chat"):
        for record in RECORDS:
            messages = [dict(m) for m in record]
            ids, mask = fmt.encode({"messages": messages}, "rec")
            text = tok.apply_chat_template(messages, tokenize=False)
            assert ids == tok(text, add_special_tokens=False)["input_ids"]
            scored, cur = [], []
            for t, m in zip(ids, mask):
                if m:
                    cur.append(t)
                elif cur:
                    scored, cur = scored + [tok.decode(cur)], []
            scored += [tok.decode(cur)] if cur else []
            want = [turn.split("<｜User｜>")[0] for turn in text.split("<｜Assistant｜>")[1:]]
            assert scored == want and len(want) == sum(m["role"] == "assistant"
                                                       for m in messages)
            assert all(w.endswith(tok.eos_token) for w in want)
    said = [r for r in caplog.records if "'<think>\\n' its generation prompt" in r.message]
    assert len(said) == 1
