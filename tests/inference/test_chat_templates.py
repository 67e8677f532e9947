"""Chat prompts equal transformers' `apply_chat_template` for each family's published template
(tests/inference/data/chat_templates, see its README): text and token ids, Llama 3.x's date from
`strftime_now`, loop controls (Cohere 2), `raise_exception` (Gemma, Mistral), `tojson`, and
`chat_template_kwargs` (Qwen3's enable_thinking) through serve."""

from __future__ import annotations

import json
import threading
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from scaletrain.inference.chat import ChatFormatError, ChatFormatter
from scaletrain.inference.loader import read_chat_template

transformers = pytest.importorskip("transformers")
from jinja2.exceptions import TemplateError  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# Mistral-7B-Instruct-v0.1's published template.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
           "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
           "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
           "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only "
           "user and assistant roles are supported!') }}{% endif %}{% endfor %}")
FAMILIES = {  # name: (template, bos, eos, other special tokens)
    "llama3_2": ("llama3_2.jinja", "<|begin_of_text|>", "<|eot_id|>",
                 ["<|start_header_id|>", "<|end_header_id|>"]),
    "llama3_1": ("llama3_1.jinja", "<|begin_of_text|>", "<|eot_id|>",
                 ["<|start_header_id|>", "<|end_header_id|>"]),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>", ["<|im_start|>", "<think>", "</think>"]),
    "qwen2_5": ("qwen2_5.jinja", None, "<|im_end|>", ["<|im_start|>"]),
    "phi3": ("phi3.jinja", "<s>", "<|endoftext|>",
             ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]),
    "gemma": ("gemma.jinja", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "deepseekv3": ("deepseekv3.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                   ["<｜User｜>", "<｜Assistant｜>"]),
    "cohere2": ("cohere2.jinja", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>",
                ["<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"]),
    "mistral": (MISTRAL, "<s>", "</s>", ["[INST]", "[/INST]"]),
}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2 + 2?"}],
    "system": [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "Name a colour <b>&</b> \"quote\"."}],
    "multi": [{"role": "user", "content": "Hi!"},
              {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello there."},
              {"role": "user", "content": "Bye ünïcode ✓"}],
    "two_users": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
}


def tokenizer_dir(tmp: Path, name: str) -> Path:
    """A byte-level tokenizer (no merges) with the family's special tokens, and the family's
    template in tokenizer_config.json, saved as a model directory would hold them."""
    source, bos, eos, extra = FAMILIES[name]
    template = source if source.startswith("{") else (TEMPLATES / source).read_text()
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t in [bos, eos, *extra] if t])
    d = tmp / name
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": eos,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if bos:
        config["bos_token"] = bos
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    d = tokenizer_dir(tmp_path_factory.mktemp("tpl"), request.param)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    template, special = read_chat_template(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ours = ChatFormatter(tok, tok.token_to_id(FAMILIES[request.param][2]), template, special)
    return request.param, ours, theirs


def _ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_prompts_equal_transformers_apply_chat_template(family, conv):
    name, ours, theirs = family
    messages = CONVERSATIONS[conv]
    try:
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:  # the template refuses it: so must we, with its message
        with pytest.raises(ChatFormatError, match="refused the conversation") as ours_err:
            ours.conversation_prompt_ids(messages)
        assert str(e) in str(ours_err.value)
        return
    assert ours.render(messages, True) == want
    ids = _ids(theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert ours.conversation_prompt_ids(messages) == ids
    if name == "llama3_2":  # today's date from strftime_now, not the fallback (3.1 has none)
        assert datetime.now().strftime("%d %b %Y") in want and "26 Jul 2024" not in want
    if name == "cohere2" and conv == "system":  # {% break %}/{% continue %} took effect
        assert want.count("Answer briefly.") == 1


def test_template_kwargs_reach_the_template(tmp_path):
    d = tokenizer_dir(tmp_path, "qwen3")
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ours = ChatFormatter(tok, tok.token_to_id("<|im_end|>"), *read_chat_template(d))
    messages = CONVERSATIONS["user"]
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False)
    assert want.endswith("<think>\n\n</think>\n\n")
    assert ours.render(messages, True, enable_thinking=False) == want
    ids = _ids(theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                          enable_thinking=False))
    assert ours.conversation_prompt_ids(messages, {"enable_thinking": False}) == ids


def test_tojson_and_generation_spans_as_in_transformers(tmp_path):
    from scaletrain.inference.chat_template import compile_template, render, render_with_spans

    source = ("{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}"
              "{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
              "{% endgeneration %}{% endif %}{% endfor %}")
    d = tokenizer_dir(tmp_path, "phi3")
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    messages = [{"role": "user", "content": "<b>é & \"x\"</b>"},
                {"role": "assistant", "content": "ok"}]
    want = theirs.apply_chat_template(messages, tokenize=False, chat_template=source)
    assert render(compile_template(source), messages, False) == want
    text, spans = render_with_spans(compile_template(source), messages)
    assert text == want and [text[s:e] for s, e in spans] == ["<a>ok</a>"]


def test_serve_passes_chat_template_kwargs(tmp_path):
    """A Qwen3-templated model served: `chat_template_kwargs` {"enable_thinking": false}
    changes the prompt to exactly transformers' tokens (usage.prompt_tokens)."""
    from scaletrain.commands.serve import make_server
    from scaletrain.inference.generators import LocalGenerator
    from tests.helpers.synth import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    d = tokenizer_dir(tmp_path, "qwen3")
    (ckpt / "tokenizer_config.json").write_text((d / "tokenizer_config.json").read_text())
    gen = LocalGenerator.from_checkpoint(ckpt)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=gen.tokenizer,
                                               chat_template=gen.chat_template,
                                               eos_token="<|endoftext|>")
    server = make_server(gen, "127.0.0.1", 0, "tiny")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for kwargs in ({}, {"enable_thinking": False}):
            body = {"messages": CONVERSATIONS["user"], "max_tokens": 1,
                    "chat_template_kwargs": kwargs}
            req = urllib.request.Request(
                f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions",
                data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                usage = json.loads(r.read())["usage"]
            want = _ids(tok.apply_chat_template(CONVERSATIONS["user"], tokenize=True,
                                                add_generation_prompt=True, **kwargs))
            assert usage["prompt_tokens"] == len(want)
            assert gen.chat_ids(CONVERSATIONS["user"], kwargs) == want
    finally:
        server.shutdown()
        server.server_close()
        server.engine.close()


def test_a_template_tripping_over_client_variables_is_a_format_error():
    """A client's `chat_template_kwargs` of the wrong type makes the template fail: a
    ChatFormatError (serve's 400), not an arbitrary exception (a 500)."""
    from tokenizers import Tokenizer as Tok

    fmt = ChatFormatter(Tok(models.WordLevel({"a": 0}, unk_token="a")), 0,
                        "{{ bos_token + messages[0]['content'] }}")
    assert fmt.render([{"role": "user", "content": "x"}], True, bos_token="<s>") == "<s>x"
    with pytest.raises(ChatFormatError, match="TypeError"):
        fmt.conversation_prompt_ids([{"role": "user", "content": "x"}], {"bos_token": {"a": 1}})
