"""`scaletrain tune [tune options] [train flags]`: measure the search's best layouts here.

Train flags (`--config`, `--model.name`, `--data.*`, `--precision.*`, `--output`, ...) are
those of `scaletrain train`; the global batch, the sequence length and the precision they give
stay fixed while the layout, micro-batch, recomputation and fused loss are tuned. Results go
to `<output>/tune/`: tune.json, tune.html, winner.toml, winner.sh, trials/<id>/.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.config import Config

log = logging.getLogger(__name__)
PROG = "scaletrain tune"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Run short profiled trials of the layouts `plan search` ranks best and "
                    "keep the fastest. Every other flag is a `scaletrain train` flag (model, "
                    "data, precision, batch, --output); see docs/tune.md.")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks per trial (default: LOCAL_WORLD_SIZE under torchrun, else 1)")
    p.add_argument("--nnodes", type=int, default=None,
                   help="nodes (default: torchrun's GROUP_WORLD_SIZE, else 1; tune runs its "
                        "trials on one node)")
    p.add_argument("--budget-minutes", type=float, default=10.0,
                   help="wall-clock budget of the whole tuning (default 10)")
    p.add_argument("--layouts", type=int, default=4,
                   help="layouts measured in the first round (the search's best, default 4)")
    p.add_argument("--variants", type=int, default=3,
                   help="variants (micro-batch, recomputation, fused loss) tried per layout")
    p.add_argument("--measure-steps", type=int, default=2,
                   help="warm steps measured per trial, after a cold first step (default 2)")
    p.add_argument("--stop-ratio", type=float, default=1.25,
                   help="stop a trial whose first two warm steps are this much slower than "
                        "the best so far")
    p.add_argument("--candidate", action="append", default=[], metavar='"FLAGS"',
                   help='also measure these train flags as given, e.g. --candidate='
                        '"--training.micro_batch_size 4" (repeatable; use the = form)')
    p.add_argument("--max-zero", type=int, choices=[0, 1, 2, 3], default=3,
                   help="highest ZeRO stage the search considers")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s per rank in the run's precision (default: "
                        "the device table; on a CPU, measured here)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory per rank the layouts must fit (default: the device's; on a "
                        "CPU the available RAM shared by the ranks)")
    p.add_argument("--intra-node-gbs", type=float, default=None,
                   help="bandwidth between ranks, GB/s (default: the device table's; on a "
                        "CPU an assumed loopback figure)")
    p.add_argument("--efficiency", type=float, default=0.6,
                   help="fraction of peak a large matmul reaches (the search's)")
    p.add_argument("--resume", action="store_true",
                   help="continue the tuning in <output>/tune: finished trials are not run "
                        "again")
    return p


def _world(a: argparse.Namespace) -> tuple[int, int]:
    env = os.environ
    nproc = a.nproc or int(env.get("LOCAL_WORLD_SIZE", "0")) or 1
    nnodes = a.nnodes or int(env.get("GROUP_WORLD_SIZE", "0")) or 1
    return nproc, nnodes


def _fail(msg: str) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    import time

    started = time.monotonic()
    a, train_argv = _parser().parse_known_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun: rank 0 tunes, launching its own trials
    nproc, nnodes = _world(a)
    if nnodes != 1:
        return _fail(f"--nnodes {nnodes}: tune runs its trials on this node only; tune on one "
                     "node, then scale the winner's data-parallel degree across nodes")
    for flag, value in (("--nproc", nproc), ("--budget-minutes", a.budget_minutes),
                        ("--layouts", a.layouts), ("--variants", a.variants),
                        ("--measure-steps", a.measure_steps)):
        if value <= 0:
            return _fail(f"{flag} must be positive (got {value})")
    if a.stop_ratio <= 1:
        return _fail(f"--stop-ratio must be above 1 (got {a.stop_ratio})")
    bad = [x for x in train_argv if x.startswith("--") and "." not in x.split("=")[0]
           and x.split("=")[0] not in ("--config", "--output")]
    if bad:
        return _fail(f"unknown option {bad[0]} (tune's own options: `{PROG} --help`; every "
                     "other flag is a `scaletrain train` --section.field flag)")
    from scaletrain.config import ConfigError, load_config
    from scaletrain.plan.layout import PlanError
    from scaletrain.tune.halving import TuneError

    try:
        cfg = load_config(train_argv, prog=PROG)
        return _tune(a, train_argv, cfg, nproc, started)
    except (ConfigError, PlanError, TuneError, ValueError) as e:
        return _fail(str(e))


def _tune(a: argparse.Namespace, train_argv: list[str], cfg: Config, nproc: int,
          started: float) -> int:
    import dataclasses
    import shlex

    from scaletrain.data.sources import resolve_model_args
    from scaletrain.plan.from_config import layout_from_config
    from scaletrain.plan.timing.step_time import Cluster
    from scaletrain.profiling.report import write_atomic
    from scaletrain.runtime import resolve_device, resolve_dtype
    from scaletrain.tune import report
    from scaletrain.tune.candidates import from_search, user_candidate
    from scaletrain.tune.halving import Tuner, TuneSetup, previous_results
    from scaletrain.tune.hardware import this_device, with_overrides

    device = resolve_device(cfg.training.device)
    precision = resolve_dtype(cfg.precision, device)
    folder = Path(cfg.output) / "tune"
    earlier = previous_results(folder / "tune.json") if a.resume else None
    if earlier and earlier.get("header", {}).get("hardware_device"):
        # the device the search predicted for then: the same ranking, the same decisions
        from scaletrain.plan.hardware import Device

        saved = earlier["header"]["hardware_device"]
        hw = Device(**{**saved, "aliases": tuple(saved.get("aliases", ()))})
    else:
        hw = this_device(device, precision, nproc, a.peak_tflops, a.memory_gib)
    hw = with_overrides(hw, precision, a.peak_tflops, a.memory_gib, a.intra_node_gbs)
    cluster = Cluster(hw, nproc, nproc, efficiency=a.efficiency)
    base = layout_from_config(cfg, device, nproc)
    args = resolve_model_args(cfg)
    specs = from_search(args, cluster, cfg.model.name, base, max_zero=a.max_zero)
    users = [user_candidate(shlex.split(c)) for c in a.candidate]
    if not specs and not users:
        print(f"{PROG}: no layout of {cfg.model.name} fits {nproc} x {hw.name} "
              f"({cluster.usable_bytes / 2**30:.2f} GiB usable per rank)", file=sys.stderr)
        return 1
    header = {"model": cfg.model.name, "world_size": nproc, "precision": precision,
              "seq_len": base.seq_len, "global_batch": base.gbs, "user_argv": train_argv,
              "hardware": {"name": hw.name, "peak_tflops": hw.peak_tflops.get(precision),
                           "memory_gib": hw.memory_gib, "intra_node_gbs": hw.intra_node_gbs},
              "hardware_device": dataclasses.asdict(hw), "search_candidates": len(specs)}
    setup = TuneSetup(train_argv, folder, nproc, device, cluster.usable_bytes,
                      a.budget_minutes * 60, a.measure_steps, a.layouts, a.variants,
                      a.stop_ratio, hw.peak_tflops.get(precision), a.resume, header, started)
    log.info("tuning %s on %d x %s (%s, global batch %d x %d tokens): %d candidates from the "
             "search, budget %.1f min -> %s", cfg.model.name, nproc, hw.name, precision,
             base.gbs, base.seq_len, len(specs), a.budget_minutes, folder)
    tuner = Tuner(setup, specs)
    tuner.run_user(users)
    tuner.run()
    files = report.write_winner(tuner)
    tuner.save()
    text = report.summary(tuner, files)
    write_atomic(folder / "tune.html", report.page(tuner, text))
    print(text)
    print(f"results: {folder / 'tune.json'}, {folder / 'tune.html'}")
    return 0 if files else 1
