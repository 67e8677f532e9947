"""Predicted against published TFLOP/s per GPU for every row of the calibration table, and where
the search ranks each published layout among the layouts it evaluates.

    python bench/plan_calibration.py [--rank] [--untied] [--one-nic] [--no-tp-overlap]
                                     [--no-dp-overlap] [--no-hsdp] [--gpt2-sp]
                                     [--breakdown] [--json OUT.json]

`--rank` runs the layout search for each run's model, cluster and batch and prints the rank the
published layout's predicted step time would take among the fitting layouts (1 = the search's
first choice; timed as the search times layouts, without a row's `tp_comm_overlap` and
`dp_overlap`), the search's own rank of its best layout with the published degrees (tp, pp,
dp, and for ZeRO-2/3 the shard group: HSDP's dp_shard), how many layouts fit, whether the
search itself evaluated the published layout (`yes`), and the search's seconds; the search
reduces gradients in the run's dtype (`reduce_dtype`) and stores bf16 weights with fp32
masters, as the published runs did (`Run.layout`). `--no-hsdp` searches without HSDP;
`--gpt2-sp` runs the GPT-2-style models sequence parallel in the search, as the trainer can
(the search keeps them without it: docs/plan.md, "GPT-2 and sequence parallelism in the
search").
`--untied` plans the GPT-style rows with untied embeddings (a planner or trainer that refuses
tied embeddings under PP can then rank them; one embedding matrix more).
`--one-nic` predicts every row with one NIC's worth per rank across nodes for the
data-parallel collectives (`Fabric.stripe_nics=False`, as the DeepSpeed 2021 rows), the
physics before NCCL's striped rings. `--no-tp-overlap` drops `tp_comm_overlap` from the rows
that carry it (Megatron-Core's --tp-comm-overlap): their TP collectives back on the critical
path, as the trainer and the search have them. `--no-dp-overlap` drops `dp_overlap` (Megatron's
distributed optimizer with overlapped reduce-scatter and all-gather): their ZeRO-1 timed as the
trainer runs it (all-reduce, then an exposed broadcast). `--breakdown` adds each row's
step-time parts (seconds: compute, tp, bubble, exposed data-parallel).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from scaletrain.plan.layout import Layout
from scaletrain.plan.search import space as search_module
from scaletrain.plan.search.calibration import BAND, DEEPSPEED_ZERO3_2021, load_runs, predict
from scaletrain.plan.search.space import search


def search_rank(pred, untied: bool, hsdp: bool = True) -> tuple[int, int | None, int, bool,
                                                                float]:
    """(rank of the published layout among the fitting layouts, the search's rank of its best
    layout with the published degrees (tp, pp, dp), how many fit, whether the search evaluated
    the published layout itself, search seconds)."""
    run = pred.run
    args = run.model_args()
    if untied:
        args = args.replace(tie_embeddings=False)
    # the search and the published layout timed as the trainer runs: TP collectives exposed,
    # ZeRO-1 as `train/zero1.py` runs it (a row's tp_comm_overlap / dp_overlap set neither)
    plain = dataclasses.replace(run, tp_comm_overlap=False, dp_overlap=None)
    t0 = time.perf_counter()
    # the run's gradient-reduction dtype: the search's FSDP layouts reduce as the run did
    # and the runs' bf16 weights with fp32 masters (`Run.layout`), which the trainer runs
    base = Layout(precision="bf16", param_dtype="bf16", fsdp_param_dtype="bf16",
                  fsdp_reduce_dtype=run.reduce_dtype)
    fitting, every = search(args, plain.cluster(), run.seq_len, run.gbs * run.seq_len, base,
                            hsdp=hsdp)
    elapsed = time.perf_counter() - t0
    own = predict(plain) if plain != run else pred
    faster = sum(1 for c in fitting if c.step_time_s < own.step_time_s * 0.995)
    # the shard group counts for ZeRO-2/3 (HSDP: dp_shard; FSDP: all of dp)
    shard = (run.dp_shard or run.dp) if run.zero >= 2 and run.dp > 1 else None

    def degrees_of(c) -> tuple:
        d = c.layout.dims
        return (d.tp, d.pp, d.dp, d.dp_shard if shard is not None else None)

    want = (run.tp, run.pp, run.dp, shard)
    seen = any(degrees_of(c) == want and (c.layout.mbs, c.layout.recompute,
                                           c.layout.zero if run.dp > 1 else None)
               == (run.mbs, run.recompute, run.zero if run.dp > 1 else None) for c in every)
    degrees = next((i + 1 for i, c in enumerate(fitting) if degrees_of(c) == want), None)
    return faster + 1, degrees, len(fitting), seen, elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", action="store_true")
    p.add_argument("--untied", action="store_true")
    p.add_argument("--one-nic", action="store_true")
    p.add_argument("--no-tp-overlap", action="store_true")
    p.add_argument("--no-dp-overlap", action="store_true")
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--no-hsdp", action="store_true",
                   help="search without HSDP layouts (the search space before it had them)")
    p.add_argument("--gpt2-sp", action="store_true",
                   help="the search runs GPT-2 models sequence parallel as well (as the "
                        "trainer can; plan/search/space.py SEQUENCE_PARALLEL_ARCHS)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.gpt2_sp:
        search_module.SEQUENCE_PARALLEL_ARCHS = ("llama", "gpt2")
    rows = []
    print(f"band {BAND[0]}-{BAND[1]}")
    print(f"{'run':<44} {'gpu':<15} {'meas':>6} {'pred':>6} {'ratio':>6}"
          + ("   rank degrees   fit eval search" if a.rank else ""))
    for run in load_runs():
        if a.untied and isinstance(run.model, dict):
            run = dataclasses.replace(run, model={**run.model, "tie_embeddings": False})
        if a.one_nic:
            run = dataclasses.replace(run, framework=DEEPSPEED_ZERO3_2021)
        if a.no_tp_overlap:
            run = dataclasses.replace(run, tp_comm_overlap=False)
        if a.no_dp_overlap:
            run = dataclasses.replace(run, dp_overlap=None)
        pred = predict(run)
        row = {"name": run.name, "gpu": run.gpu, "gpus": run.gpus, "measured": pred.measured_tflops,
               "predicted": round(pred.predicted_tflops, 1), "ratio": round(pred.ratio, 3),
               "flops": run.flops, "source": run.source,
               "times_s": {k: round(v, 4) for k, v in pred.times.items()}}
        line = (f"{run.name:<44} {run.gpu:<15} {pred.measured_tflops:>6.0f} "
                f"{pred.predicted_tflops:>6.0f} {pred.ratio:>6.2f}")
        if a.rank:
            rank, degrees, fit, seen, secs = search_rank(pred, a.untied, not a.no_hsdp)
            row.update(rank=rank, degrees_rank=degrees, fitting=fit, evaluated=seen,
                       search_s=round(secs, 2))
            line += (f"  {rank:>5} {degrees or '-':>7} {fit:>5} {'yes' if seen else 'no':>4} "
                     f"{secs:5.1f}s")
        if a.breakdown:
            t = pred.times
            line += (f"  compute {t['compute']:.3f} tp {t['tp_comm']:.3f} bubble {t['bubble']:.3f}"
                     f" dp {t['dp_comm_exposed']:.3f}")
        print(line, flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
