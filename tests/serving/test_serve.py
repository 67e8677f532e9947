"""`scaletrain serve` answers the OpenAI protocol; the HTTP client retries, budgets, and gets
the same greedy text as in-process generation."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scaletrain.commands.serve import make_server
from scaletrain.inference.generators import BudgetExhausted, LocalGenerator, SamplingParams
from scaletrain.synth.http_client import HTTPError, HTTPGenerator
from tests.helpers.synth import lines as _lines
from tests.helpers.synth import tiny_checkpoint

PROMPTS = ["the cat sat on", "a dog ran in the", "rain falls", "we like to read books and",
           "the sun"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt")
    gen = LocalGenerator.from_checkpoint(ckpt, batch_size=4)
    server = make_server(gen, "127.0.0.1", 0, "tiny", batch_size=4)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}/v1", gen, ckpt, server
    server.shutdown()
    server.server_close()
    server.engine.close()


def test_http_greedy_text_equals_in_process(served):
    url, _, ckpt, server = served
    local = LocalGenerator.from_checkpoint(ckpt, batch_size=8)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, top_p=None)
    expected = [c.text for c in local.complete(PROMPTS, params)]
    assert len(set(expected)) > 1  # the tiny model does say different things
    before = server.engine.batches
    client = HTTPGenerator(url, model="tiny", concurrency=5)
    got = client.complete(PROMPTS, params)
    assert [c.text for c in got] == expected
    assert all(c.tokens > 0 for c in got) and client.tokens_generated == sum(c.tokens for c in got)
    assert server.engine.batches - before <= len(PROMPTS)  # concurrent requests may share
    chat = HTTPGenerator(url, model="tiny", chat=True).complete(["hello"], params)[0]
    ids = local.chat_ids([{"role": "user", "content": "hello"}])
    assert chat.text == local.decode(local.complete_ids([ids], params)[0])


def test_openai_package_client(served):
    openai = pytest.importorskip("openai")
    url, _, ckpt, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    local = LocalGenerator.from_checkpoint(ckpt)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, top_p=None)
    assert r.choices[0].text == local.complete([PROMPTS[0]], params)[0].text
    assert r.usage.completion_tokens == local.complete_ids([local.encode(PROMPTS[0])],
                                                           params)[0].__len__()
    r2 = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6,
                                   temperature=1.0, n=3, seed=5)
    assert len(r2.choices) == 3 and [c.index for c in r2.choices] == [0, 1, 2]
    c = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0,
                                       messages=[{"role": "user", "content": "hi there"}])
    assert c.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=2)


def test_bad_requests_get_clear_errors(served):
    url = served[0]

    def post(path, body):
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    code, body = post("/completions", {"prompt": 3})
    assert code == 400 and "prompt" in body["error"]["message"]
    code, body = post("/completions", {"prompt": "the cat", "max_tokens": 2, "top_p": 2})
    assert code == 400 and "top_p" in body["error"]["message"]
    code, body = post("/nope", {})
    assert code == 404
    with pytest.raises(HTTPError, match="HTTP 400"):  # not retried
        HTTPGenerator(url, max_retries=3).post("/completions", {"prompt": []})


class _Flaky(BaseHTTPRequestHandler):
    """503 for the first `fail` requests, then a valid completion."""

    fail = 2
    seen = 0

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        type(self).seen += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).seen <= type(self).fail:
            self.send_response(503)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"choices": [{"text": "ok", "finish_reason": "stop"}],
                           "usage": {"completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_client_retries_backoff_and_request_budget():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = HTTPGenerator(url, max_retries=3, backoff_s=0.01, max_requests=2)
        params = SamplingParams(max_new_tokens=2)
        assert client.complete(["x"], params)[0].text == "ok"
        assert client.retries == 2 and client.requests_sent == 3
        with pytest.raises(BudgetExhausted):
            client.complete(["a", "b"], params)  # 1 used + 2 more > 2: refused before sending
        assert client.requests_sent == 3
        _Flaky.seen, _Flaky.fail = 0, 10
        with pytest.raises(HTTPError, match="HTTP 503"):
            HTTPGenerator(url, max_retries=1, backoff_s=0.01).complete(["x"], params)
    finally:
        server.shutdown()
        server.server_close()
    down = HTTPGenerator(url, max_retries=0, timeout_s=2)
    with pytest.raises(HTTPError, match="is the server up"):
        down.complete(["x"], SamplingParams())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_data_synth_over_http_matches_in_process(served, tmp_path, temperature):
    from scaletrain.synth.config import load_config
    from scaletrain.synth.runner import SynthRunner

    url, _, ckpt, _ = served
    common = {"prompts.template": "the {topic} sat on", "prompts.num_prompts": 4,
              "prompts.candidates": 2, "prompts.slots.topic": ["cat", "dog", "sun"],
              "generator.max_new_tokens": 8, "generator.temperature": temperature,
              "judge.rubric": "{prompt} {candidate} score:", "judge.max_new_tokens": 4}
    http = SynthRunner(load_config(None, {**common, "generator.url": url, "generator.model": "tiny",
                                          "output": str(tmp_path / "http")})).run()
    local = SynthRunner(load_config(None, {**common, "generator.checkpoint": str(ckpt),
                                           "output": str(tmp_path / "local")})).run()
    assert http["generated"] == local["generated"] == 8
    rows = [[json.loads(x) for x in _lines(tmp_path / d / "candidates.jsonl")]
            for d in ("http", "local")]
    assert [(r["id"], r["candidate"], r["critique"], r["kept"]) for r in rows[0]] == \
        [(r["id"], r["candidate"], r["critique"], r["kept"]) for r in rows[1]]
    assert http["session"]["http_requests"] == 16  # 8 candidates + 8 critiques
