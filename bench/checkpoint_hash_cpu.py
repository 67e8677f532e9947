"""What checkpoint integrity costs: xxh3_128 hashing speed, and save/load time with and without
the manifest (hashes at save, verification at load) on a native checkpoint of a real model size.

    python bench/checkpoint_hash_cpu.py                 # a ~0.5 GB fp32 checkpoint
    python bench/checkpoint_hash_cpu.py --mb 2000 --repeats 3

The model is a Llama of `--mb` megabytes of fp32 weights, saved with `save_model_checkpoint`
(DCP + meta.json + manifest) into a temporary directory on the same disk as `--dir`. Rows:
  hash            : xxh3_128 over every file of the checkpoint (page cache warm), MB/s
  save            : save_model_checkpoint (includes hashing); `save - hash` is DCP's own cost
  load verify=on  : load_model_checkpoint with hash verification (the default)
  load verify=off : the same with verification off (safe unpickling and finite checks stay)
Each row is the median of `--repeats` runs. Results print as a table and go to
bench/results/checkpoint_hash_cpu.json. Timings on a shared machine vary; the files are in the
page cache, so these are CPU costs, not disk speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scaletrain.checkpoint.integrity import checkpoint_files, file_hash, verification  # noqa: E402
from scaletrain.checkpoint.native_format import (  # noqa: E402
    load_model_checkpoint,
    save_model_checkpoint,
)
from scaletrain.models.args import ModelArgs  # noqa: E402
from scaletrain.models.transformer import build_model  # noqa: E402


def _args_for(mb: float, dim: int) -> ModelArgs:
    """A Llama whose fp32 weights take about `mb` megabytes (layers as needed)."""
    vocab, ffn = 8192, dim * 11 // 4
    per_layer = 4 * dim * dim + 3 * dim * ffn + 2 * dim
    layers = max(1, round((mb * 1e6 / 4 - 2 * vocab * dim) / per_layer))
    return ModelArgs(dim=dim, n_layers=layers, n_heads=16, n_kv_heads=16, vocab_size=vocab,
                     ffn_dim=ffn, max_seq_len=256)


def _median(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=500.0, help="checkpoint size in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dim", type=int, default=1024, help="model width")
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint_hash_cpu.json"))
    a = p.parse_args(argv)
    args = _args_for(a.mb, a.dim)
    model = build_model(args, seed=0)
    work = Path(tempfile.mkdtemp(prefix="ckpt-hash-", dir=a.dir))
    try:
        ck = work / "ck"
        n = 0

        def save() -> None:
            nonlocal n
            n += 1
            save_model_checkpoint(model, args, work / f"s{n}")
            shutil.rmtree(work / f"s{n}")

        save_model_checkpoint(model, args, ck)
        size = sum((ck / f).stat().st_size for f in checkpoint_files(ck)) / 1e6
        files = [ck / f for f in checkpoint_files(ck)]
        load_model_checkpoint(ck)  # warm-up: imports, page cache
        t_hash = _median(lambda: [file_hash(f) for f in files], a.repeats)
        t_save = _median(save, a.repeats)
        on, off = [], []
        for _ in range(a.repeats):  # interleaved, so drift on a shared machine hits both
            with verification(True):
                on.append(_median(lambda: load_model_checkpoint(ck), 1))
            with verification(False):
                off.append(_median(lambda: load_model_checkpoint(ck), 1))
        t_on, t_off = statistics.median(on), statistics.median(off)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "checkpoint_mb": round(size, 1), "repeats": a.repeats,
        "hash_s": round(t_hash, 3), "hash_mb_per_s": round(size / t_hash),
        "save_s": round(t_save, 3), "load_verify_on_s": round(t_on, 3),
        "load_verify_off_s": round(t_off, 3),
        "load_on_minus_off_s": round(t_on - t_off, 3),  # mostly noise on a shared machine
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version()},
    }
    print(f"checkpoint {size:.0f} MB (fp32 Llama, {args.n_layers} layers, dim {args.dim})")
    print(f"{'hash (xxh3_128)':<18}{t_hash:8.3f} s  {size / t_hash:8.0f} MB/s")
    print(f"{'save':<18}{t_save:8.3f} s  (hashing is {100 * t_hash / t_save:.0f}% of it)")
    print(f"{'load verify=on':<18}{t_on:8.3f} s")
    print(f"{'load verify=off':<18}{t_off:8.3f} s")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
