"""What the manifest check costs and what it saves, and how fast an absurd micro-batch is refused.

    python bench/manifest_check_cpu.py                  # the debug preset's model (7 M params)
    python bench/manifest_check_cpu.py --preset llama-small --repeats 5

Rows (each the median of `--repeats` runs, in-process, files in the page cache):
  check native / check hf : the manifest checked against `.metadata` / the safetensors headers
                            on a good checkpoint (`checked_model_args`, `hf_model_args`): what
                            every load now pays
  load native / load hf   : the whole load (`load_model`), for scale
  refuse <fmt> <field>    : the same call on a manifest with n_layers 10^7, vocab_size 10^12 or
                            a mismatched hidden size: the time to the one-line refusal
  meta blocks / layer     : building blocks on the meta device, seconds and resident memory per
                            layer (1,000 and 10,000 layers): the work a believed n_layers does
                            before any tensor is read; x 10^7 is what the old path would have
                            spent (extrapolated, not run)
  refuse micro-batch      : `check_before_setup` (plan + advice) for the debug config with a
                            micro-batch of 4096
Results print as lines and go to bench/results/manifest_check_cpu.json.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.checkpoint_hash_cpu import _median  # noqa: E402
from scaletrain.checkpoint.integrity import MANIFEST_NAME, write_manifest  # noqa: E402
from scaletrain.checkpoint.native_format import (  # noqa: E402
    checked_model_args,
    read_meta,
    save_model_checkpoint,
)
from scaletrain.inference.loader import load_model  # noqa: E402
from scaletrain.models.args import get_preset  # noqa: E402
from scaletrain.models.hf import hf_model_args, save_hf_checkpoint  # noqa: E402
from scaletrain.models.transformer import Transformer, build_model  # noqa: E402

DAMAGES = {"n_layers": ("num_hidden_layers", 10**7), "vocab_size": ("vocab_size", 10**12),
           "dim": ("hidden_size", None)}


def _refusal(fn: Callable[[], Any], repeats: int) -> tuple[float, str]:
    times, message = [], ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            fn()
        except ValueError as e:
            message = str(e)
        else:
            raise SystemExit("a damaged manifest was accepted")
        times.append(time.perf_counter() - t0)
    return statistics.median(times), message


def _damaged(good: Path, fmt: str, field: str, dim: int, work: Path) -> Path:
    out = work / f"{fmt}-{field}"
    shutil.copytree(good, out)
    if fmt == "native":
        meta = json.loads((out / "meta.json").read_text())
        meta["model_args"][field] = DAMAGES[field][1] or dim + 32
        (out / "meta.json").write_text(json.dumps(meta))
        (out / MANIFEST_NAME).unlink()
        write_manifest(out)
    else:
        cfg = json.loads((out / "config.json").read_text())
        key, value = DAMAGES[field]
        cfg[key] = value or dim + 32
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _meta_blocks_per_layer(args: Any, layers: int) -> tuple[float, float]:
    """(seconds, resident bytes) per layer of a model built on the meta device."""
    rss, t0 = _rss_bytes(), time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args.replace(n_layers=layers))
    seconds = (time.perf_counter() - t0) / layers
    grown = (_rss_bytes() - rss) / layers
    del model
    return seconds, grown


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="debug")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "manifest_check_cpu.json"))
    a = p.parse_args(argv)
    args = get_preset(a.preset)
    rows: dict[str, Any] = {"preset": a.preset, "params": sum(
        t.numel() for t in build_model(args, seed=0).parameters()),
        "host": platform.node(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_model(args, seed=0)
        good = {"native": save_model_checkpoint(model, args, work / "native"),
                "hf": save_hf_checkpoint(model, work / "hf")}
        check = {"native": lambda d: checked_model_args(d, read_meta(d)),
                 "hf": hf_model_args}
        for fmt, path in good.items():
            rows[f"check {fmt} s"] = _median(lambda f=fmt, d=path: check[f](d), a.repeats)
            rows[f"load {fmt} s"] = _median(lambda d=path: load_model(d), a.repeats)
            for field in DAMAGES:
                bad = _damaged(path, fmt, field, args.dim, work)
                seconds, message = _refusal(lambda f=fmt, d=bad: check[f](d), a.repeats)
                rows[f"refuse {fmt} {field} s"] = seconds
                rows[f"refuse {fmt} {field} message"] = message
    for layers in (1000, 10000):
        seconds, grown = _meta_blocks_per_layer(args, layers)
        rows[f"meta blocks per layer s ({layers} layers)"] = seconds
        rows[f"meta blocks per layer KiB resident ({layers} layers)"] = grown / 1024
    rows["meta blocks for 10^7 layers h (extrapolated)"] = seconds * 1e7 / 3600
    rows["meta blocks for 10^7 layers GiB (extrapolated)"] = grown * 1e7 / 2**30

    from scaletrain.commands._memory_fit import RunOutOfMemory, check_before_setup, training_plan
    from scaletrain.config import load_config

    cfg = load_config(["--training.micro_batch_size", "4096", "--training.device", "cpu"])
    t0 = time.perf_counter()
    try:
        check_before_setup(training_plan(cfg), torch.device("cpu"), skip=False)
        rows["refuse micro-batch message"] = "(not refused: this host has the memory)"
    except RunOutOfMemory as e:
        rows["refuse micro-batch message"] = str(e)
    rows["refuse micro-batch s"] = time.perf_counter() - t0

    for key, value in rows.items():
        print(f"{key:<48} {value:.4f}" if isinstance(value, float) else f"{key:<48} {value}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
