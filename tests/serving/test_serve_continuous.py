"""`scaletrain serve` with continuous batching: a short request is answered while a long one
still decodes (a static batch makes it wait), requests with different sampling settings share
the batch and each gets what it gets alone, and a client that goes away (a broken stream, a
closed connection, a timed-out request) stops its row's decoding while the server goes on.

The model sleeps 20 ms per forward pass so that timings are not races.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from scaletrain.commands.serve import ServerLimits, make_server
from scaletrain.inference.batch_decode import Row, decode_rows
from scaletrain.inference.generators import LocalGenerator
from tests.helpers.synth import tiny_checkpoint

STEP_S = 0.02


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("serve-cont") / "ckpt")
    g = LocalGenerator.from_checkpoint(ckpt, batch_size=2)
    orig = g.model.forward

    def slow(*a, **k):
        time.sleep(STEP_S)
        return orig(*a, **k)

    g.model.forward = slow
    return g


def _serve(gen, continuous=True, **limits):
    server = make_server(gen, "127.0.0.1", 0, "tiny", batch_size=2,
                         limits=ServerLimits(**limits), continuous=continuous)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def served(gen):
    server = _serve(gen)
    yield server.server_address[1], server.engine
    server.shutdown()
    server.server_close()
    server.engine.close()


def post(port, body, timeout=60):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps({"model": "tiny", **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return json.loads(r.read())


def wait_idle(port, timeout=15.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = metrics(port)
        if m["occupied_slots"] == 0 and m["waiting_rows"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"the engine is still busy: {m}")


def alone(gen, prompt, max_tokens, temperature=0.0, top_k=None, top_p=None, seed=None,
          bias=None):
    row = Row(gen.encode(prompt), max_tokens, seed, logit_bias=bias or {})
    return gen.decode(decode_rows(gen.model, [row], temperature, top_k, top_p, gen.eos_id,
                                  gen.pad_id)[0].ids)


def _long_and_short(port, cat):
    """A long request (80 tokens: the end-of-text token cannot end it early), then a short
    one 0.3 s later: (text, end time) of each."""
    out = {}

    def send(name, body, delay):
        time.sleep(delay)
        r = post(port, body)
        out[name] = (r["choices"][0]["text"], time.monotonic())

    threads = [threading.Thread(target=send, args=a) for a in [
        ("long", {"prompt": "the cat", "max_tokens": 80, "temperature": 0,
                  "logit_bias": {str(cat): 100}}, 0.0),
        ("short", {"prompt": "rain falls on the", "max_tokens": 3, "temperature": 0}, 0.3)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_short_request_is_answered_while_a_long_one_decodes(served, gen):
    port, engine = served
    assert engine.continuous
    cat = gen.encode("cat")[0]
    out = _long_and_short(port, cat)
    assert out["short"][1] < out["long"][1] - 0.5  # it did not wait for the long row
    assert out["long"][0] == alone(gen, "the cat", 80, bias={cat: 100})
    assert len(out["long"][0].split()) == 80
    assert out["short"][0] == alone(gen, "rain falls on the", 3)
    m = wait_idle(port)
    assert m["batching"] == "continuous" and 0 < m["mean_slot_occupancy"] <= 1


def test_static_batching_makes_the_short_request_wait(gen):
    server = _serve(gen, continuous=False)
    try:
        out = _long_and_short(server.server_address[1], gen.encode("cat")[0])
        assert out["short"][1] >= out["long"][1] - 0.1  # answered with or after the long one
        assert out["short"][0] == alone(gen, "rain falls on the", 3)
    finally:
        server.shutdown()
        server.server_close()
        server.engine.close()


def test_mixed_sampling_settings_share_the_batch_and_equal_each_alone(served, gen):
    port, _ = served
    bodies = [{"prompt": "the cat", "max_tokens": 12, "temperature": 0},
              {"prompt": "a dog ran in the park", "max_tokens": 6, "temperature": 1.0,
               "seed": 3, "top_p": 0.9},
              {"prompt": "we like", "max_tokens": 9, "temperature": 0.7, "seed": 5,
               "top_k": 10},
              {"prompt": "the sun is", "max_tokens": 4, "temperature": 1.2, "seed": 8}]
    got: dict[int, str] = {}

    def send(i):
        time.sleep(0.05 * i)
        got[i] = post(port, bodies[i])["choices"][0]["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, b in enumerate(bodies):
        assert got[i] == alone(gen, b["prompt"], b["max_tokens"], b["temperature"],
                               b.get("top_k"), b.get("top_p"), b.get("seed"))


def _raw_post(port, body):
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps({"model": "tiny", **body}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def test_a_disconnected_stream_stops_decoding_and_the_server_goes_on(served, gen):
    port, _ = served
    before = wait_idle(port)
    cat = gen.encode("cat")[0]  # every token visible text, so every token is written
    s = _raw_post(port, {"prompt": "the", "max_tokens": 100, "stream": True,
                         "logit_bias": {str(cat): 100}, "temperature": 0})
    got = b""
    while got.count(b"data:") < 2:
        got += s.recv(4096)
    s.close()
    after = wait_idle(port)
    assert after["rows_cancelled"] == before["rows_cancelled"] + 1
    decoded = after["tokens"] - before["tokens"]
    assert 2 <= decoded < 50  # of a budget of 100
    r = post(port, {"prompt": "the cat", "max_tokens": 5, "temperature": 0})
    assert r["choices"][0]["text"] == alone(gen, "the cat", 5)


def test_a_closed_connection_cancels_a_waiting_non_stream_request(served):
    port, _ = served
    before = wait_idle(port)
    s = _raw_post(port, {"prompt": "the", "max_tokens": 100, "temperature": 0})
    time.sleep(0.4)
    s.close()
    after = wait_idle(port)
    assert after["rows_cancelled"] == before["rows_cancelled"] + 1
    assert after["tokens"] - before["tokens"] < 50


@pytest.mark.parametrize("continuous", [True, False])
def test_a_timed_out_request_is_cancelled(gen, continuous):
    server = _serve(gen, continuous, request_timeout_s=0.3)
    port = server.server_address[1]
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(port, {"prompt": "the", "max_tokens": 100, "temperature": 0})
        assert e.value.code == 504
        m = wait_idle(port)
        assert m["rows_cancelled"] == 1 and m["tokens"] < 50
    finally:
        server.shutdown()
        server.server_close()
        server.engine.close()


def test_an_error_fails_only_its_rows_and_the_engine_goes_on(gen):
    from scaletrain.serving.engine import BatchingEngine

    engine = BatchingEngine(gen, batch_size=3)
    ids = gen.encode("the cat")

    def boom(new):
        if len(new) == 2:
            raise RuntimeError("a callback failed")
        return False

    try:
        futs = engine.submit([Row(ids, 5), Row(ids, 5, stop=boom), Row([], 5)], (0.0, None, None))
        assert gen.decode(futs[0].result(30).ids) == alone(gen, "the cat", 5)
        with pytest.raises(RuntimeError, match="callback"):
            futs[1].result(30)
        with pytest.raises(ValueError, match="empty"):
            futs[2].result(30)
        orig = gen.model.forward
        gen.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
        try:
            futs = engine.submit([Row(ids, 5), Row(ids, 4)], (0.0, None, None))
            for f in futs:
                with pytest.raises(RuntimeError, match="device lost"):
                    f.result(30)
        finally:
            gen.model.forward = orig
        again = engine.submit([Row(ids, 5)], (0.0, None, None))[0].result(30)
        assert gen.decode(again.ids) == alone(gen, "the cat", 5)
    finally:
        engine.close()


def test_a_prompt_longer_than_the_batch_position_joins_at_once(gen):
    """A newcomer whose prompt is longer than the running batch's column, and one whose
    budget runs past the context from that column, join the running row at once (the
    live columns move; positions are per row) and decode what they decode alone."""
    from scaletrain.serving.engine import BatchingEngine

    engine = BatchingEngine(gen, batch_size=3)
    greedy = (0.0, None, None)
    cat = gen.encode("cat")[0]
    ctx = gen.model.args.max_seq_len
    try:
        running = engine.submit([Row(gen.encode("the"), 60, logit_bias={cat: 100})], greedy)[0]
        time.sleep(0.2)  # decoding: the batch's column is about 10
        long_prompt = gen.encode(" ".join(["the cat sat on the mat"] * 6))
        assert len(long_prompt) > 25
        short = gen.encode("rain falls")
        late = [Row(long_prompt, 3), Row(short, ctx - len(short))]
        futs = engine.submit(late[:1], greedy) + engine.submit(late[1:], greedy)
        assert len(futs[0].result(30).ids) == 3 and not running.done()  # it did not wait
        for fut, row in zip(futs, late):
            with gen.lock:  # the engine decodes the other rows meanwhile
                want = decode_rows(gen.model, [Row(row.prompt, row.max_new_tokens)],
                                   eos_id=gen.eos_id)[0].ids
            assert fut.result(60).ids == want
        assert len(running.result(30).ids) == 60 and engine.batches == 1  # never drained
    finally:
        engine.close()
