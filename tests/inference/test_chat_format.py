"""One prompt format: SFT formatting, predict, serve's chat endpoint and data synth (chat) put
the same tokens before the model's reply, with the model's chat template or the default."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import urllib.request

import pytest

from scaletrain.commands import predict as predict_cmd
from scaletrain.commands.serve import make_server
from scaletrain.finetune.loading import Finetuned
from scaletrain.inference.chat import ChatFormatter
from scaletrain.inference.generators import LocalGenerator, SamplingParams
from scaletrain.inference.loader import load_model
from tests.helpers.synth import tiny_checkpoint

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.fixture(scope="module", params=["template", "default"])
def ckpt(request, tmp_path_factory):
    base = tiny_checkpoint(tmp_path_factory.mktemp("chat") / "base")
    if request.param == "template":
        path = base.parent / "templated"
        shutil.copytree(base, path)
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
        return path
    return base


def _chat(port: int, content, max_tokens: int = 6) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_sft_predict_serve_and_synth_share_one_prompt_format(ckpt):
    loaded = load_model(ckpt)
    assert (loaded.chat_template is not None) == (ckpt.name == "templated")
    fmt = ChatFormatter(loaded.tokenizer, loaded.eos_id, loaded.chat_template,
                        loaded.special_tokens)
    prompt = "the cat sat on"
    ids, mask = fmt.encode({"prompt": prompt, "response": "the mat"}, "rec")
    before_reply = ids[: mask.index(True)]
    assert fmt.prompt_ids(prompt) == before_reply  # predict

    gen = LocalGenerator.from_checkpoint(ckpt, batch_size=2)
    assert gen.chat_ids([{"role": "user", "content": prompt}]) == before_reply  # serve
    server = make_server(gen, "127.0.0.1", 0, "tiny")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        plain = _chat(port, prompt)
        parts = _chat(port, [{"type": "text", "text": "the cat "},
                             {"type": "text", "text": "sat on"}])
    finally:
        server.shutdown()
        server.server_close()
        server.engine.close()
    assert plain["usage"]["prompt_tokens"] == len(before_reply)
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]

    params = SamplingParams(max_new_tokens=6, temperature=0.0, top_p=None)
    synth = LocalGenerator.from_checkpoint(ckpt, chat=True).complete([prompt], params)[0]
    assert synth.text == plain["choices"][0]["message"]["content"]  # synth (chat)

    done = Finetuned(loaded.model, loaded, {"task": "sft"})
    args = argparse.Namespace(max_new_tokens=6, temperature=0.0)
    assert predict_cmd.respond(done, [prompt], args)[0]["response"] == synth.text
