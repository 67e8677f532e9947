"""`scaletrain serve` with slow clients open: requests/s and latency of small completions while
0, 64 and 256 connections trickle a request head one byte at a time (loopback, CPU).

    python bench/serve_slow_clients_cpu.py                       # levels 0,64,256
    python bench/serve_slow_clients_cpu.py --baseline-root /work/main  # also another checkout

The server runs `scaletrain serve` (the `debug` preset, random weights, as bench/serve_cpu.py)
in a subprocess with 1 torch thread. For each level, `--slow` sockets are opened first; each
sends the start of a request line and then one more byte every `--trickle-s` seconds (never
finishing its head). Then `--concurrency` client threads send `--requests` small completions
in total (`max_tokens` `--max-tokens`, greedy), each on a new connection. Reported per level:
requests/s, latency median/p95/max, how many requests failed (status other than 200) and
how many slow sockets the server had closed by the end (408 or reset).

The slow sockets come from one address (loopback), so with the server's default
`--max-slow-per-client 64` a client holding more than 64 loses its oldest: the `held` mode
raises that bound (and the read/header timeouts) so that all of them stay open and their
cost is measured; the `default` mode runs with the default limits. `--baseline-root` runs
another checkout's `scaletrain serve` the same way, twice: `baseline` with its own flags set
to admit every slow socket (`--max-connections 4096`, `--read-timeout 600`) and `base-dflt`
with its defaults. Timings on a shared machine
vary; raw results go to bench/results/serve_slow_clients_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from synth_cpu import make_checkpoint  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "serve_slow_clients_cpu.json"


def start(ckpt: Path, root: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "serve", "--checkpoint",
                             str(ckpt), "--port", "0", "--batch-size", "8", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=root, env=env)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"scaletrain serve did not start: {line!r}")
    return proc, line.split(" on ")[1].split()[0].removesuffix("/v1")


class SlowClients(threading.Thread):
    """`n` sockets trickling a request head, one byte per socket every `every_s`."""

    def __init__(self, port: int, n: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.sel = selectors.DefaultSelector()
        self.socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
            s.setblocking(False)
            self.socks.append(s)
            self.sel.register(s, selectors.EVENT_READ)
        self.every_s, self.stop, self.closed = every_s, threading.Event(), set()

    def run(self) -> None:
        while not self.stop.is_set():
            deadline = time.monotonic() + self.every_s
            for s in self.socks:
                if s not in self.closed:
                    try:
                        s.send(b"a")
                    except OSError:
                        self.closed.add(s)
            while (left := deadline - time.monotonic()) > 0 and not self.stop.is_set():
                for key, _ in self.sel.select(min(left, 0.1)):
                    s = key.fileobj
                    try:
                        data = s.recv(65536)  # type: ignore[union-attr]
                    except OSError:
                        data = b""
                    if not data or data.startswith(b"HTTP/1.1 408"):
                        self.closed.add(s)  # type: ignore[arg-type]
                        self.sel.unregister(s)

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        for s in self.socks:
            s.close()


def load(base: str, requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"prompt": "def main(", "max_tokens": max_tokens, "temperature": 0})
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    todo = iter(range(requests))

    def worker() -> None:
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            t0 = time.perf_counter()
            req = urllib.request.Request(f"{base}/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                ok = r.status == 200
                why = str(r.status)
            except (urllib.error.URLError, OSError) as e:
                ok, why = False, getattr(e, "code", type(e).__name__)
            with lock:
                (latencies.append(time.perf_counter() - t0) if ok else failures.append(str(why)))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = sorted(latencies)
    return {"requests": requests, "ok": len(q), "failed": len(failures),
            "failures": sorted(set(failures)), "wall_s": round(wall, 3),
            "requests_per_s": round(len(q) / wall, 2),
            "latency_median_s": round(statistics.median(q), 4) if q else None,
            "latency_p95_s": round(q[min(len(q) - 1, int(0.95 * len(q)))], 4) if q else None,
            "latency_max_s": round(q[-1], 4) if q else None}


def run_mode(name: str, ckpt: Path, root: Path, flags: list[str], levels: list[int],
             a: argparse.Namespace) -> list[dict[str, Any]]:
    proc, base = start(ckpt, root, flags)
    port = int(base.rsplit(":", 1)[1])
    rows = []
    try:
        load(base, 4, 2, a.max_tokens)  # warm-up
        for n in levels:
            slow = SlowClients(port, n, a.trickle_s)
            slow.start()
            time.sleep(a.settle_s)
            res = load(base, a.requests, a.concurrency, a.max_tokens)
            res.update(mode=name, slow=n, slow_closed_by_server=len(slow.closed))
            slow.close()
            rows.append(res)
            print(f"{name:>9} slow={n:>4}: {res['requests_per_s']:>7} req/s  median "
                  f"{res['latency_median_s']} s  p95 {res['latency_p95_s']} s  failed "
                  f"{res['failed']} {res['failures']}  slow closed {len(slow.closed)}",
                  flush=True)
            time.sleep(a.settle_s)
    finally:
        proc.kill()
        proc.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="0,64,256")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--trickle-s", type=float, default=1.0)
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--modes", default="held,default")
    p.add_argument("--baseline-root", default=None,
                   help="another scaletrain checkout whose `serve` to run the same way")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    held = ["--max-slow-per-client", "4096", "--max-connections", "4096",
            "--read-timeout", "600", "--header-timeout", "600"]
    modes = {"held": (ROOT, held), "default": (ROOT, [])}
    chosen = {m: modes[m] for m in a.modes.split(",") if m}
    if a.baseline_root:
        chosen["baseline"] = (Path(a.baseline_root), ["--max-connections", "4096",
                                                      "--read-timeout", "600"])
        chosen["base-dflt"] = (Path(a.baseline_root), [])  # its own default limits
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "ckpt")
        rows = []
        for name, (root, flags) in chosen.items():
            rows += run_mode(name, ckpt, root, flags, levels, a)
    out = {"environment": {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count()},
           "settings": {k: v for k, v in vars(a).items() if k != "out"}, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
