"""`scaletrain serve` under bounded concurrent load (loopback): one at a time, static and
continuous batching; and `scaletrain eval` in-process vs lm_eval's `local-completions`
through `serve`.

    python bench/serve_cpu.py                          # debug model, 48 requests, 8 in flight
    python bench/serve_cpu.py --requests 24 --concurrency 4 --skip-eval

The `debug` preset (random weights, BPE tokenizer trained here, as bench/synth_cpu.py).
Serve: `scaletrain serve` in a subprocess with `--batch-size B` for each B of `--batch-sizes`
(1 = one request at a time) and, for B > 1, each `--batching` mode (static: a batch runs
until all its rows have finished; continuous: rows join and leave between tokens), repeated
`--repeats` times in alternating order; `--concurrency` client threads send `--requests`
completion requests in total (prompts of mixed lengths, max_tokens drawn from
8..`--max-tokens`, greedy, so rows of one batch finish at different times). Reported:
requests/s, generated tokens/s, latency median and p95, the server's mean slot occupancy
and its batch starts (`GET /metrics` `batches`: for continuous batching, how often the batch
started from empty; for static batching, the batches; the warm-up included over HTTP),
whether every server gave the same text; and, on the largest batch size, one request
carrying B prompts vs the same B prompts as concurrent requests. `--engine` runs
the same load on the batching engine in this process too (no HTTP, no client threads
competing with the server for the CPU).

Eval: the same tiny task set (loglikelihood, multiple choice, generate_until, rolling
loglikelihood; `--eval-docs` documents each) with `scaletrain eval` in-process and with
lm_eval through a `serve` subprocess (lm_eval's default batch size 1), wall time each, and
whether the metrics agree. Torch runs `--threads` threads (default 1) in every process.
Results print as a table and go to bench/results/serve_cpu.json. Timings on a shared machine vary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402
from synth_cpu import TOPICS, make_checkpoint, start_server  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "serve_cpu.json"
_TEXT = ("the water cycle moves rain from the sea to the hills and back again while bees "
         "visit flowers and compilers turn source code into machine instructions")
WORDS = _TEXT.split()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def request_bodies(requests: int, max_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"model": "bench", "prompt": f"Write about {rng.choice(TOPICS)}: "
             + " ".join(rng.choices(WORDS, k=rng.randint(2, 60))),
             "max_tokens": rng.randint(8, max_tokens), "temperature": 0}
            for _ in range(requests)]


def closed_loop(send: Any, requests: int, concurrency: int) -> dict[str, Any]:
    """`send(i) -> (text, completion tokens)` for i < `requests`, `concurrency` clients each
    sending its next request when the last one is answered; latencies, totals and texts."""
    latencies: list[float] = []
    texts: list[str] = [""] * requests
    tokens = [0]
    lock = threading.Lock()
    todo = list(range(requests))

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            t0 = time.perf_counter()
            text, n = send(i)
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)
                texts[i] = text
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latencies.sort()
    return {"wall_s": round(wall, 3), "requests_per_s": round(requests / wall, 3),
            "tokens_per_s": round(tokens[0] / wall, 1), "completion_tokens": tokens[0],
            "latency_median_s": round(statistics.median(latencies), 3),
            "latency_p95_s": round(latencies[min(len(latencies) - 1,
                                                 int(0.95 * len(latencies)))], 3),
            "texts": texts}


def load(url: str, requests: int, concurrency: int, max_tokens: int,
         seed: int = 0) -> dict[str, Any]:
    """`requests` completions over HTTP, `concurrency` in flight."""
    bodies = request_bodies(requests, max_tokens, seed)

    def send(i: int) -> tuple[str, int]:
        r = _post(url, bodies[i])
        return r["choices"][0]["text"], r["usage"]["completion_tokens"]

    return closed_loop(send, requests, concurrency)


def engine_load(ckpt: Path, batch_size: int, continuous: bool, requests: int,
                concurrency: int, max_tokens: int) -> dict[str, Any]:
    """The same load on the batching engine in this process (no HTTP, no client processes
    competing for the CPU): what the batching itself gains."""
    from scaletrain.inference.batch_decode import Row
    from scaletrain.inference.generators import LocalGenerator
    from scaletrain.serving.engine import BatchingEngine

    gen = LocalGenerator.from_checkpoint(ckpt)
    bodies = request_bodies(requests, max_tokens)
    rows = [Row(gen.encode(b["prompt"]), b["max_tokens"]) for b in bodies]
    engine = BatchingEngine(gen, batch_size, continuous=continuous)

    def send(i: int) -> tuple[str, int]:
        d = engine.submit([rows[i]], (0.0, None, None))[0].result()
        return gen.decode(d.ids), len(d.ids)

    try:
        engine.submit([rows[0]], (0.0, None, None))[0].result()  # warm-up
        r = closed_loop(send, requests, concurrency)
        m = engine.metrics()
        r["mean_slot_occupancy"] = m["mean_slot_occupancy"]
        r["batches"] = m["batches"] - 1  # less the warm-up's
        return r
    finally:
        engine.close()


def _metrics(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/metrics", timeout=30) as r:
        return json.loads(r.read())


def prompt_list(url: str, prompts: int, max_tokens: int, seed: int = 0) -> dict[str, float]:
    """One request carrying `prompts` prompts vs the same prompts as concurrent requests."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(2, 60))) for _ in range(prompts)]
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    one = _post(url, {**body, "prompt": texts})
    as_list = time.perf_counter() - t0
    outs: list[str] = [""] * prompts

    def send(i: int) -> None:
        outs[i] = _post(url, {**body, "prompt": texts[i]})["choices"][0]["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(prompts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    concurrent = time.perf_counter() - t0
    same = [c["text"] for c in sorted(one["choices"], key=lambda c: c["index"])] == outs
    return {"prompts": prompts, "one_request_s": round(as_list, 3),
            "concurrent_requests_s": round(concurrent, 3), "same_text": same}


def write_tasks(directory: Path, docs: int, seed: int = 0) -> list[str]:
    """Four tiny local tasks, one per lm_eval request kind."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)

    def sentence(k: int) -> str:
        return " ".join(rng.choices(WORDS, k=k))

    data = {
        "bench_ll": [{"context": sentence(8), "target": " " + rng.choice(WORDS)}
                     for _ in range(docs)],
        "bench_mc": [{"q": sentence(8), "choices": rng.sample(WORDS, 3), "label": 0}
                     for _ in range(docs)],
        "bench_gen": [{"q": sentence(6), "a": sentence(3)} for _ in range(docs)],
        "bench_rolling": [{"text": sentence(40)} for _ in range(docs)],
    }
    bodies = {
        "bench_ll": 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\n'
                    'doc_to_target: "{{target}}"\nmetric_list:\n  - metric: acc\n',
        "bench_mc": 'output_type: multiple_choice\ndoc_to_text: "{{q}}"\n'
                    'doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n'
                    '  - metric: acc\n',
        "bench_gen": 'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
                     'generation_kwargs: {until: ["."], max_gen_toks: 16, do_sample: false}\n'
                     'metric_list:\n  - metric: exact_match\n',
        "bench_rolling": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                         'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n',
    }
    for name, rows in data.items():
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {path}\ntest_split: test\n{bodies[name]}")
    return list(data)


def _numbers(results: dict[str, Any]) -> dict[str, float]:
    return {f"{t}/{k}": v for t, m in results["results"].items() for k, v in m.items()
            if isinstance(v, float) and "stderr" not in k}


def eval_times(ckpt: Path, work: Path, docs: int) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from scaletrain.commands import eval as eval_cmd

    tasks = write_tasks(work / "tasks", docs)
    # the end-of-text token both sides use (lm_eval: as the rolling-window prefix and a stop)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eot|>"}))
    args = eval_cmd.build_parser().parse_args(
        ["--checkpoint", str(ckpt), "--tasks", ",".join(tasks), "--include-path",
         str(work / "tasks"), "--bootstrap-iters", "0", "--device", "cpu"])
    t0 = time.perf_counter()
    local = eval_cmd.run(args)
    in_process = time.perf_counter() - t0
    tok = work / "hf-tokenizer"  # what lm_eval's client reads with transformers
    tok.mkdir(exist_ok=True)
    shutil.copy(next(ckpt.glob("*tokenizer.json")), tok / "tokenizer.json")
    shutil.copy(ckpt / "tokenizer_config.json", tok / "tokenizer_config.json")
    proc, url = start_server(ckpt, 8)
    try:
        t0 = time.perf_counter()
        remote = simple_evaluate(
            model="local-completions", tasks=tasks, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(work / "tasks"), include_defaults=False),
            model_args={"base_url": url + "/completions", "model": ckpt.name,
                        "tokenizer": str(tok), "max_length": 1024})
        served = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    a, b = _numbers(local), _numbers(remote)
    worst = max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in a)
    return {"docs_per_task": docs, "tasks": tasks, "in_process_s": round(in_process, 2),
            "through_serve_s": round(served, 2), "metrics_in_process": a,
            "metrics_through_serve": b,
            "max_relative_difference": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--batching", default="static,continuous",
                   help="modes compared for batch sizes > 1")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--engine", action="store_true",
                   help="also the same load on the engine in-process (no HTTP)")
    p.add_argument("--eval-docs", type=int, default=20)
    p.add_argument("--skip-eval", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=str(RESULTS))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # for the server subprocesses
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    modes = a.batching.split(",")
    servers = [(b, m) for b in sizes for m in (modes if b > 1 else ["static"])]
    rows: dict[str, Any] = {}
    texts: list[list[str]] = []
    lists = None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "bench")
        for rep in range(a.repeats):
            for b, mode in servers if rep % 2 == 0 else servers[::-1]:
                proc, url = start_server(ckpt, b, "--batching", mode)
                try:
                    load(url, min(4, a.requests), min(4, a.concurrency), 8, seed=1)  # warm-up
                    r = load(url, a.requests, a.concurrency, a.max_tokens)
                    texts.append(r.pop("texts"))
                    m = _metrics(url)
                    r["mean_slot_occupancy"] = m.get("mean_slot_occupancy")
                    r["batches"] = m.get("batches")  # warm-up's included
                    rows[f"{b} {mode}" + (f" #{rep + 1}" if a.repeats > 1 else "")] = r
                    if b == max(sizes) and mode == modes[-1] and lists is None:
                        lists = prompt_list(url, b, a.max_tokens)
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
        engine_rows: dict[str, Any] = {}
        for rep in range(a.repeats if a.engine else 0):
            for b, mode in servers if rep % 2 == 0 else servers[::-1]:
                r = engine_load(ckpt, b, mode == "continuous", a.requests, a.concurrency,
                                a.max_tokens)
                texts.append(r.pop("texts"))
                engine_rows[f"{b} {mode}" + (f" #{rep + 1}" if a.repeats > 1 else "")] = r
        evals = None if a.skip_eval else eval_times(ckpt, Path(tmp), a.eval_docs)
    same = all(t == texts[0] for t in texts)
    print(f"serve: {a.requests} requests, {a.concurrency} in flight, max_tokens 8..{a.max_tokens}"
          f", {a.threads} thread(s); every server gave the same text: {same}")
    for title, table in (("through HTTP", rows), ("engine in-process", engine_rows)):
        if not table:
            continue
        print(f"{title + ': batch, mode':<36}{'req/s':>8}{'tok/s':>9}{'p50 s':>8}{'p95 s':>8}"
              f"{'slots':>7}{'starts':>8}")
        for name, r in table.items():
            occ = r["mean_slot_occupancy"]
            print(f"{'  ' + name:<36}{r['requests_per_s']:>8.2f}{r['tokens_per_s']:>9.1f}"
                  f"{r['latency_median_s']:>8.2f}{r['latency_p95_s']:>8.2f}"
                  f"{'' if occ is None else f'{occ:.2f}':>7}{r.get('batches') or '':>8}")
    if lists:
        print(f"{lists['prompts']} prompts in one request: {lists['one_request_s']:.2f} s; as "
              f"{lists['prompts']} concurrent requests: {lists['concurrent_requests_s']:.2f} s;"
              f" same text: {lists['same_text']}")
    if evals:
        print(f"eval ({len(evals['tasks'])} tasks x {evals['docs_per_task']} docs): in-process "
              f"{evals['in_process_s']:.1f} s, through serve {evals['through_serve_s']:.1f} s, "
              f"metrics differ by at most {evals['max_relative_difference']:.1e} (relative)")
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_average_1min_at_end": round(os.getloadavg()[0], 2),
           "threads": a.threads, "torch": torch.__version__, "requests": a.requests,
           "concurrency": a.concurrency, "max_tokens": a.max_tokens, "serve": rows,
           "engine_in_process": engine_rows,
           "same_text_every_server": same,
           "prompt_list": lists,
           "eval": evals}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
