"""`scaletrain plan --method` against the peak GPU memory torchtune publishes per recipe.

    python bench/plan_vs_torchtune.py [--data bench/data/torchtune_memory.toml] [--json OUT]

Each row of the data file is one published figure with the recipe's settings and its source
(repository path and commit). For each row this prints two plans:

- `ours`: the `scaletrain plan` command of the run our trainer would make of that recipe (the
  same model, method, LoRA rank and targets, batch, sequence length, activation checkpointing,
  optimizer, GPUs and FSDP, CPU offload; `training.fused_loss` with chunks of 1/8 of the
  tokens where the recipe chunks its loss), run in-process; the command is printed.
- `matched`: our formulas with what torchtune's recipe does differently put in:
  * model states: bf16 parameters with no fp32 masters (torchtune trains in pure bf16;
    FSDP shards bf16; QLoRA's NF4 as `finetune_estimate` counts it next to bf16), bf16
    gradients and AdamW moments of the trainable parameters, none on the device with FSDP
    CPU offload, no gradient buffer with the optimizer step fused into backward, and 8-bit
    paged optimizer states outside PyTorch's allocator (CUDA unified memory: torchtune's
    peak statistics do not see them);
  * activations of bf16 parameters (a bf16 residual stream, no autocast weight copies);
  * the loss: `CEWithChunkedOutputLoss` keeps the head's bf16 logits of every chunk for
    backward and works on one chunk of 1/8 of the tokens in fp32 at a time (our fused-loss
    formula for that chunk) instead of our full logits, fp32 log-softmax and gradients;
  * activation offloading: the checkpointed block inputs live on the host;
  * FSDP's root unit: gathered at the end of forward in both trainers (embedding, norm,
    head), less the embedding where the recipe shards it as a unit of its own
    (`custom_sharded_layers`; torchtune reshards each unit after its forward).
  What stays unmodelled (torch.compile's fusion, the allocator, the statistic) is named
  per row.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 2**30
DATA = Path(__file__).parent / "data" / "torchtune_memory.toml"
STATES = ("weights", "gradients", "master_weights", "optimizer")


def load_rows(path: Path = DATA) -> list[dict[str, Any]]:
    return tomllib.loads(path.read_text())["row"]


def plan_argv(row: dict[str, Any], param_dtype: str | None = None,
              fused_loss: bool = True) -> list[str]:
    """`scaletrain plan` arguments of the run our trainer makes of `row`'s recipe. Our QLoRA
    keeps fp32 parameters (`finetune` refuses bf16 ones), our LoRA and full runs bf16
    parameters with fp32 masters; `param_dtype` overrides that. Where the recipe chunks its
    loss ours runs `training.fused_loss` with chunks of the same tokens (`fused_loss`)."""
    argv = ["--model", row["model"], "--method", row["method"], "--mbs", str(row["mbs"]),
            "--seq-len", str(row["seq"]), "--precision", "bf16",
            "--recompute", "full" if row["ac"] else "none",
            "--param-dtype", param_dtype or ("fp32" if row["method"] == "qlora" else "bf16"),
            "--optimizer", "adamw8bit" if row["optimizer"] == "paged_adamw8bit" else "adamw"]
    if row["method"] in ("lora", "qlora"):
        argv += ["--lora-rank", str(row["lora_rank"]),
                 "--lora-targets", ",".join(row["lora_targets"])]
    if fused_loss and row["loss"] == "chunked":
        argv += ["--fused-loss", "--loss-chunk", str(row["mbs"] * row["seq"] // CE_CHUNKS)]
    if row["gpus"] > 1:
        argv += ["--dp", str(row["gpus"]), "--zero", "3"]
        if row["fsdp_cpu_offload"]:
            argv.append("--cpu-offload")
    return argv


def run_plan(argv: list[str]) -> dict[str, Any]:
    """The JSON `scaletrain plan ARGV --json` prints (in-process)."""
    from scaletrain.commands.plan import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([*argv, "--json"])
    if rc != 0:
        raise SystemExit(f"scaletrain plan {shlex.join(argv)} failed ({rc})")
    return json.loads(out.getvalue())


def torchtune_states(row: dict[str, Any], plan: dict[str, Any]) -> dict[str, int]:
    """torchtune's model states per GPU for `row`, from our parameter counts."""
    from scaletrain.commands._plan_args import parse_model
    from scaletrain.plan.finetune.estimate import estimate

    n = row["gpus"]
    if row["fsdp_cpu_offload"]:  # every sharded state, gradients included, on the host
        return dict.fromkeys(STATES, 0)
    lora = row["method"] in ("lora", "qlora")
    ft = estimate(parse_model(row["model"], []), row["method"],
                  rank=row.get("lora_rank", 8),
                  **({"targets": tuple(row["lora_targets"])} if lora else {}),
                  weight_bytes=2)
    trainable = ft.trainable / n
    grads = 0 if row["optimizer_in_bwd"] else int(2 * trainable)
    optimizer = 0 if row["optimizer"] == "paged_adamw8bit" else int(2 * 2 * trainable)
    return {"weights": ft.weight_bytes // n, "gradients": grads, "master_weights": 0,
            "optimizer": optimizer}


CE_CHUNKS = 8  # CEWithChunkedOutputLoss's num_output_chunks


def torchtune_loss(row: dict[str, Any], plan: dict[str, Any]) -> tuple[int, int]:
    """(saved, transient) bytes of torchtune's loss for `row`: the bf16 logits of every chunk
    kept for backward, and one chunk's fp32 working set (our fused-loss formula for a chunk
    of tokens / 8), where `plan` keeps full logits (`logits_loss` and the loss activations)."""
    from scaletrain.commands._plan_args import parse_model
    from scaletrain.plan.memory.activations import ActivationSpec, logits_buffer_bytes

    args = parse_model(row["model"], [])
    tokens = row["mbs"] * row["seq"]
    spec = ActivationSpec(mbs=row["mbs"], seq_len=row["seq"], compute_dtype="bf16",
                          residual_dtype="bf16", fused_loss=True,
                          loss_chunk=tokens // CE_CHUNKS)
    return 2 * tokens * args.vocab_size, logits_buffer_bytes(args, spec)


def matched_peak(row: dict[str, Any], plan: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """Peak of `plan` (made with bf16 parameters) with torchtune's model states, loss and
    activation offloading (see the module's docstring)."""
    from scaletrain.plan.estimate import peak_bytes

    mem = {k: v for k, v in plan["memory_bytes"].items() if k not in ("total", "peak")}
    mem.update(torchtune_states(row, plan))
    act = plan["activation_bytes"]
    saved_loss, mem["logits_loss"] = torchtune_loss(row, plan)
    mem["activations"] += saved_loss - act["loss"]
    if row["act_offload"]:  # what each checkpointed block keeps: its input
        mem["activations"] -= act["norms"] + act["attention"] + act["mlp"]
    if "tok_embeddings" in row.get("custom_sharded_layers", []):
        from scaletrain.commands._plan_args import parse_model

        args = parse_model(row["model"], [])
        mem["root_gathered"] -= 2 * args.vocab_size * args.dim
    return peak_bytes(mem, 1, comm_at_step_only=row["gpus"] == 1), mem


def differences(row: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """What the recipe does that neither plan models, and what our trainer does differently."""
    out = []
    loss = ours["memory_bytes"]["logits_loss"] + ours["activation_bytes"].get("loss", 0)
    if row["loss"] == "chunked":
        out.append("loss: torchtune's chunked cross-entropy keeps the bf16 logits of "
                   "every chunk (matched); ours runs training.fused_loss with chunks of as "
                   f"many tokens, no logits kept (its loss terms: {loss / GIB:.2f} GiB)")
    if row["act_offload"]:
        out.append("activation offloading: torchtune keeps the checkpointed block inputs on "
                   "the host (matched)")
    if row["compile"]:
        out.append("torch.compile: fuses elementwise ops (fewer saved tensors); not planned")
    if row["gpus"] > 1 and not row["fsdp_cpu_offload"] and row["method"] != "full":
        out.append("FSDP: both trainers keep bf16 shards of the frozen base (ours with "
                   "--param-dtype bf16); ours keeps fp32 shards of the trainable parameters "
                   "(the masters), torchtune bf16 ones")
    if row["gpus"] > 1:
        out.append("FSDP: our root unit (embedding, norm, head) stays gathered from forward "
                   "through backward; torchtune's is gathered at the end of forward"
                   + (" without the embedding (a unit of its own)"
                      if row.get("custom_sharded_layers") else ""))
    if row["optimizer"] == "paged_adamw8bit":
        out.append("PagedAdamW8bit: paged states in CUDA unified memory, outside torch's "
                   "statistics; ours plans adamw8bit on the device")
    if row["optimizer_in_bwd"]:
        out.append("optimizer step fused into backward: no gradient buffer (ours: fp32 "
                   "gradients and masters)")
    if row["method"] == "qlora":
        out.append("QLoRA: our trainer keeps fp32 non-quantized weights (ours); matched "
                   "plans them bf16 as torchtune")
    if row.get("unstated"):
        out.append("settings beyond batch/seq/compile not stated for this GPU (figure ~2x "
                   "the 24 GB card's: activation checkpointing likely off)")
    if row["stat"] != "active":
        out.append("statistic unnamed (active, allocated or reserved peak)")
    return out


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for row in rows:
        argv = plan_argv(row)
        ours = run_plan(argv)
        # matched: our bf16 plan with the full logits, which torchtune's loss then replaces
        bf16 = run_plan(plan_argv(row, "bf16", fused_loss=False))
        peak, mem = matched_peak(row, bf16)
        published = int(row["published_gib"] * GIB)
        results.append({
            "id": row["id"], "source": row["source"], "config": row["config"],
            "gpus": row["gpus"], "gpu": row["gpu"], "stat": row["stat"],
            "published_bytes": published,
            "ours_bytes": ours["memory_bytes"]["peak"],
            "matched_bytes": peak,
            "ours_memory": ours["memory_bytes"], "matched_memory": mem,
            "command": "scaletrain plan " + shlex.join(argv),
            "differences": differences(row, ours)})
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    head = (f"{'recipe':<17} {'GPUs':>4} {'published':>10} {'ours':>8} {'ours/pub':>9} "
            f"{'matched':>8} {'match/pub':>9}  stat")
    lines = [head, "-" * len(head)]
    for r in results:
        pub, ours, m = r["published_bytes"], r["ours_bytes"], r["matched_bytes"]
        lines.append(f"{r['id']:<17} {r['gpus']:>4} {pub / GIB:>10.1f} {ours / GIB:>8.1f} "
                     f"{ours / pub:>9.2f} {m / GIB:>8.1f} {m / pub:>9.2f}  {r['stat']}")
    lines.append("GiB per GPU. ours: the plan of our trainer's run of the recipe; matched: "
                 "that plan with torchtune's model states.")
    for r in results:
        lines += ["", f"{r['id']}  ({r['source']}: {r['config']}, {r['gpus']} x {r['gpu']})",
                  f"  {r['command']}"]
        keys = [k for k in r["ours_memory"] if k not in ("total", "peak")
                and (r["ours_memory"][k] or r["matched_memory"].get(k))]
        lines.append("  term (GiB)       " + "".join(f"{k[:12]:>13}" for k in keys))
        lines.append("  ours             " + "".join(f"{r['ours_memory'][k] / GIB:>13.2f}"
                                                    for k in keys))
        lines.append("  matched          " + "".join(f"{r['matched_memory'][k] / GIB:>13.2f}"
                                                    for k in keys))
        lines += [f"  - {d}" for d in r["differences"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    a = p.parse_args()
    results = compare(load_rows(a.data))
    print(format_table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
