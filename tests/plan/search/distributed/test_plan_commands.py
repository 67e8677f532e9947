"""The search's commands run: the top layouts of `plan search` for a small model on 4 "GPUs"
start and train 2 steps on CPU through their `command` (torchrun, gloo), and the metrics of a
multi-rank run are per device."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.models.args import get_preset
from scaletrain.plan.flops import flops_per_token
from scaletrain.plan.hardware import get_device
from scaletrain.plan.layout import Layout
from scaletrain.plan.search.space import search
from scaletrain.plan.timing.step_time import Cluster
from tests.helpers.proc import scaled
from tests.helpers.trainer import tiny_argv

SEQ = 32
# The tiny model of the trainer tests, as `--set` overrides of the debug preset.
ARGS = get_preset("debug").replace(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                   vocab_size=512)


def _data_flags(out: Path, cache: Path) -> list[str]:
    """Everything of the trainer tests' tiny run except the model, batch and layout."""
    argv = tiny_argv(out, cache, "--training.steps", "2")
    keep, skip = [], {"--training.micro_batch_size", "--training.grad_accum_steps"}
    i = 0
    while i < len(argv):
        if argv[i].startswith("--model.") or argv[i] in skip:
            i += 2
            continue
        keep.append(argv[i])
        i += 1
    return keep


def _launch(flags: list[str], nproc: int, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", "scaletrain", "train", *flags]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[4]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(timeout))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_per_device(lines: list[dict], world: int) -> None:
    fpt = flops_per_token(ARGS, SEQ)
    for m in lines:
        assert m["tokens_per_s_per_device"] == pytest.approx(m["tokens_per_s"] / world)
        assert m["tflops"] * 1e12 == pytest.approx(fpt * m["tokens_per_s"] / world, rel=1e-9)


def _top_layouts(n: int) -> list:
    """The best fitting layout, then the best of each other parallel structure (degrees and
    whether FSDP shards), `n` in all. Two "nodes" of two GPUs: sharding inside a node and
    replicating across them (HSDP, dp_replicate 2 x dp_shard 2) is the search's best FSDP."""
    base = Layout(precision="fp32", kernels="cpu")
    fitting, _ = search(ARGS, Cluster(get_device("H100"), 4, gpus_per_node=2), SEQ, SEQ * 16,
                        base, model="debug")
    chosen, seen = [], set()
    for c in fitting:
        d = c.layout.dims
        key = (d.tp, d.pp, d.cp, c.layout.fsdp)
        if key not in seen:
            seen.add(key)
            chosen.append(c)
    return chosen[:n]


def test_top_search_layouts_train_through_their_command(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    layouts = _top_layouts(3)
    assert len(layouts) == 3 and any(c.layout.fsdp for c in layouts)
    assert any(c.layout.fsdp and c.layout.dims.dp_replicate > 1 for c in layouts)  # HSDP
    assert any(c.layout.dims.tp * c.layout.dims.pp > 1 for c in layouts)
    for i, c in enumerate(layouts):
        argv = shlex.split(c.command)
        # the per-node line of a 2-node job; its train flags run here on one host's 4 ranks
        assert argv[:5] == ["torchrun", "--nnodes", "2", "--nproc_per_node", "2"]
        out = tmp_path / f"run{i}"
        # The data flags first: every flag of the command wins where both set one.
        flags = _data_flags(out, cache) + argv[argv.index("train") + 1:]
        proc = _launch(flags, 4)
        assert proc.returncode == 0, (c.command, proc.stderr[-3000:])
        lines = _metrics(out)
        assert [m["step"] for m in lines] == [1, 2]
        _check_per_device(lines, 4)
        config = (out / "config.toml").read_text()
        assert f'data_parallel = "{c.layout.data_parallel}"' in config
        d = c.layout.dims
        assert f"dp_replicate = {d.dp_replicate}" in config
        assert f"dp_shard = {d.dp_shard}" in config


def test_two_rank_metrics_are_per_device(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    flags = _data_flags(out, tmp_path / "cache") + [
        "--model.name", "debug", "--model.dim", "64", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "128",
        "--model.vocab_size", "512", "--training.micro_batch_size", "2",
        "--training.grad_accum_steps", "2", "--parallel.data_parallel", "ddp",
        "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"]
    proc = _launch(flags, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _metrics(out)
    _check_per_device(lines, 2)
    for m in lines:  # the job's tokens: global batch (2 x 2 x 2 sequences) x sequence
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(8 * SEQ, rel=1e-6)


def test_search_expert_parallel_layout_trains_through_its_command(tmp_path: Path) -> None:
    """A Mixture-of-Experts model: the best layout the search proposes with expert
    parallelism starts and trains through its command (4 ranks, gloo)."""
    moe = ARGS.replace(n_experts=4, n_experts_per_token=2, moe_ffn_dim=64)
    fitting, _ = search(moe, Cluster(get_device("H100"), 4), SEQ, SEQ * 16,
                        Layout(precision="fp32", kernels="cpu"), model="debug")
    chosen = next(c for c in fitting if c.layout.dims.ep > 1)
    argv = shlex.split(chosen.command)
    assert "--model.n_experts" in argv and "--parallel.ep" in argv
    out = tmp_path / "ep"
    proc = _launch(_data_flags(out, tmp_path / "cache") + argv[argv.index("train") + 1:], 4)
    assert proc.returncode == 0, (chosen.command, proc.stderr[-3000:])
    lines = _metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    assert f"ep = {chosen.layout.dims.ep}" in (out / "config.toml").read_text()
