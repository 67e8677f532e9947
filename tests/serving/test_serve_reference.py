"""`scaletrain serve` under concurrent load against plain greedy decoding without a KV cache
(the whole sequence through the model for every token), written here: requests of different
prompt lengths (up to the full context), budgets and stop strings arrive while others decode,
in continuous and static batching. Each response's text, finish reason and usage equal the
reference's; streamed chunks concatenate to the same text."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request

import pytest
import torch

from scaletrain.commands.serve import make_server
from scaletrain.inference.generators import LocalGenerator, cut_at_stop
from tests.helpers.synth import tiny_checkpoint


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: on a busy machine 2 threads ran 70x slower
    yield LocalGenerator.from_checkpoint(
        tiny_checkpoint(tmp_path_factory.mktemp("serve-ref") / "ckpt"))
    torch.set_num_threads(threads)


@torch.inference_mode()
def reference(gen: LocalGenerator, prompt: list[int], max_tokens: int, stop: list[str],
              bias: dict[str, float]) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of greedy decoding without a cache."""
    ctx = gen.model.args.max_seq_len
    ids, new = list(prompt), []
    for _ in range(min(max_tokens, ctx - len(prompt))):
        logits = gen.model(torch.tensor([ids]))[0, -1].float()
        for tok, b in bias.items():
            logits[int(tok)] += b
        new.append(int(logits.argmax()))
        ids.append(new[-1])
        text, stopped = cut_at_stop(gen.decode(new), stop)
        if new[-1] == gen.eos_id or stopped:
            return text, "stop", len(new)
    return gen.decode(new), "length", len(new)


def _requests(gen: LocalGenerator) -> list[dict]:
    rng = random.Random(0)
    ctx = gen.model.args.max_seq_len
    out = []
    for k, n in enumerate([3, 120, 40, 1, 127, ctx, 9, 90, 60, 15]):
        body = {"model": "tiny", "prompt": [rng.randrange(2, 128) for _ in range(n)],
                "max_tokens": [5, 40, 200, 17][k % 4], "temperature": 0,
                "logit_bias": {str(gen.eos_id): -100} if k % 3 == 0 else {}}
        if k % 3 == 1:  # a stop string the greedy text reaches
            text = reference(gen, body["prompt"], body["max_tokens"], [], {})[0]
            if len(text) > 6:
                body["stop"] = [text[4:6]]
        out.append(body)
    return out


def _post(port: int, body: dict) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


@pytest.mark.parametrize("continuous", [True, False])
def test_concurrent_requests_equal_greedy_without_a_cache(gen, continuous):
    bodies = _requests(gen)
    want = [reference(gen, b["prompt"], b["max_tokens"], b.get("stop", []), b["logit_bias"])
            for b in bodies]
    server = make_server(gen, "127.0.0.1", 0, "tiny", batch_size=3, continuous=continuous)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    got: dict[int, dict] = {}
    streamed: dict[int, str] = {}

    def send(k: int) -> None:
        time.sleep(0.03 * k)  # later requests join while earlier ones decode
        got[k] = json.loads(_post(port, bodies[k]))
        if k % 2:
            events = [json.loads(x[6:]) for x in _post(port, {**bodies[k], "stream": True})
                      .split("\n\n") if x.startswith("data: {")]
            streamed[k] = "".join(c["text"] for e in events for c in e["choices"])

    try:
        threads = [threading.Thread(target=send, args=(k,)) for k in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.shutdown()
        server.server_close()
        server.engine.close()
    assert server.engine.rows_decoded == len(bodies) + len(streamed)
    for k, b in enumerate(bodies):
        c, usage = got[k]["choices"][0], got[k]["usage"]
        assert usage["prompt_tokens"] == len(b["prompt"])
        assert usage["total_tokens"] == len(b["prompt"]) + usage["completion_tokens"]
        assert (c["text"], c["finish_reason"], usage["completion_tokens"]) == want[k], k
        if k in streamed:
            assert streamed[k] == c["text"], k
