"""`scaletrain serve` speaks the OpenAI protocol: echo + logprobs, token-id prompts, streaming,
logit controls, and every refusal is OpenAI-shaped JSON while the server stays up."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest
import torch

from scaletrain.commands.serve import ServerLimits, make_server
from scaletrain.inference.generators import LocalGenerator, SamplingParams
from tests.helpers.synth import tiny_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("serve-openai") / "ckpt")
    gen = LocalGenerator.from_checkpoint(ckpt, batch_size=4)
    limits = ServerLimits(max_n=4, max_rows=8, max_body_bytes=20_000, read_timeout_s=1.0,
                          max_connections=3)
    server = make_server(gen, "127.0.0.1", 0, "tiny", batch_size=4, limits=limits)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], gen
    server.shutdown()
    server.server_close()
    server.engine.close()


def request(port, method, path, body=None, raw=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                   **(headers or {})})
    r = conn.getresponse()
    out = r.status, r.getheader("Content-Type"), r.read()
    conn.close()
    return out


def post(port, path, body):
    status, _, data = request(port, "POST", "/v1" + path, body)
    return status, json.loads(data)


def test_echo_logprobs_of_token_id_prompts_equal_a_forward_pass(served):
    port, gen = served
    prompts = [gen.encode("the cat sat on the mat"), gen.encode("rain falls")]
    status, r = post(port, "/completions", {"model": "tiny", "prompt": prompts, "echo": True,
                                            "logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert status == 200 and len(r["choices"]) == 2
    for ids, c in zip(prompts, sorted(r["choices"], key=lambda c: c["index"])):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        with torch.no_grad():
            logp = gen.model(torch.tensor([ids]))[0].float().log_softmax(-1)
        want = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
        greedy = int(logp[-1].argmax())
        assert lp["token_logprobs"][-1] == pytest.approx(float(logp[-1, greedy]), abs=1e-4)
        for tok, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert len(top) == 1 and max(top.values()) >= tok
        assert c["text"].startswith(gen.decode(ids))
    assert r["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_max_tokens_zero_and_string_list_prompts(served):
    port, gen = served
    status, r = post(port, "/completions", {"prompt": "the sun", "max_tokens": 0, "echo": True,
                                            "logprobs": 0})
    assert status == 200 and r["choices"][0]["text"] == gen.decode(gen.encode("the sun"))
    assert r["usage"]["completion_tokens"] == 0
    prompts = ["the cat", "a dog ran in the park", "we"]
    status, r = post(port, "/completions", {"prompt": prompts, "max_tokens": 6,
                                            "temperature": 0})
    local = gen.complete(prompts, SamplingParams(max_new_tokens=6, temperature=0, top_p=None))
    assert [c["text"] for c in r["choices"]] == [c.text for c in local]


def test_stop_string_ends_decoding_and_counts(served):
    port, gen = served
    free = post(port, "/completions", {"prompt": "the cat", "max_tokens": 30,
                                       "temperature": 0})[1]
    text = free["choices"][0]["text"]
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[1]
    _, r = post(port, "/completions", {"prompt": "the cat", "max_tokens": 30,
                                       "temperature": 0, "stop": stop})
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"] == text[: text.index(stop)]
    assert r["usage"]["completion_tokens"] < free["usage"]["completion_tokens"]


def test_logit_bias_and_penalties_take_effect(served):
    port, gen = served
    tok = gen.encode("mat")[0]
    _, r = post(port, "/completions", {"prompt": "the cat", "max_tokens": 4, "temperature": 0,
                                       "logit_bias": {str(tok): 100}})
    assert r["choices"][0]["text"].split() == ["mat"] * 4
    _, r = post(port, "/completions", {"prompt": "the cat", "max_tokens": 12, "temperature": 0,
                                       "frequency_penalty": 2.0, "logit_bias": {str(tok): 5}})
    assert r["choices"][0]["text"].split().count("mat") < 12


def test_streaming_with_the_openai_client(served):
    openai = pytest.importorskip("openai")
    port, gen = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    whole = client.completions.create(model="tiny", prompt="the cat", max_tokens=10,
                                      temperature=0)
    parts = list(client.completions.create(model="tiny", prompt="the cat", max_tokens=10,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert len(parts) > 2 and parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    words = whole.choices[0].text.split()
    stop = " " + words[1]  # a stop string met mid-stream: never sent, ends the choice
    cut = client.completions.create(model="tiny", prompt="the cat", max_tokens=10,
                                    temperature=0, stop=stop)
    parts = list(client.completions.create(model="tiny", prompt="the cat", max_tokens=10,
                                           temperature=0, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in parts) == cut.choices[0].text
    assert stop not in cut.choices[0].text and parts[-1].choices[0].finish_reason == "stop"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                                 temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"


HARDENING = [
    ("POST", "/v1/completions", {"prompt": "x", "temperature": float("nan")}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": float("inf")}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "n": 5}, 400),
    ("POST", "/v1/completions", {"prompt": ["x"] * 3, "n": 3}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 3}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "tools": []}, 400),
    ("POST", "/v1/completions", {"prompt": [[1, 2, 999]]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "json_object"}}, 400),
    ("POST", "/v1/completions", {"prompt": "the cat " * 200}, 400),
    ("POST", "/v1/nothing", {}, 404),
    ("PUT", "/v1/completions", {}, 405),
    ("DELETE", "/v1/models", None, 405),
    ("GET", "/v1/models/other", None, 404),
    ("POST", "/v1/completions", "x" * 30_000, 413),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), HARDENING)
def test_refusals_are_openai_json_and_the_server_stays_up(served, method, path, body, status):
    port, _ = served
    raw = body.encode() if isinstance(body, str) else None
    if raw is None and body is not None:
        raw = json.dumps(body, allow_nan=True).encode()
    got, ctype, data = request(port, method, path, raw=raw)
    assert got == status, data
    assert ctype == "application/json"
    err = json.loads(data)["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    assert request(port, "GET", "/health")[0] == 200


def test_stalled_upload_times_out_and_others_are_served(served):
    port, _ = served
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\":")
    t0 = time.monotonic()
    assert post(port, "/completions", {"prompt": "the", "max_tokens": 1})[0] == 200
    s.settimeout(10)
    chunks = []
    while chunk := s.recv(4096):  # the server closes the connection after its answer
        chunks.append(chunk)
    s.close()
    reply = b"".join(chunks).decode()
    assert reply.startswith("HTTP/1.1 408") and '"error"' in reply
    assert time.monotonic() - t0 < 5


def _reply(s: socket.socket, timeout: float = 10) -> str:
    s.settimeout(timeout)
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := s.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_stalled_connections_give_way_to_new_ones(served):
    """At `max_connections` (3) stalled connections, a new client is still served: the oldest
    stalled connection is closed with 408 to make room, the others at their deadline."""
    port, _ = served
    stalled = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # and nothing more
        stalled.append(s)
        time.sleep(0.05)
    t0 = time.monotonic()
    assert request(port, "GET", "/health")[0] == 200
    assert time.monotonic() - t0 < 1.0  # not after the stalled ones timed out
    replies = [_reply(s) for s in stalled]
    assert all(r.startswith("HTTP/1.1 408") and '"error"' in r for r in replies), replies
    assert time.monotonic() - t0 < 5
    for s in stalled:
        s.close()
