"""Distributed checkpoints: saved in one layout, resumed in another (the resumed losses equal
the uninterrupted single-process run), loaded in one process, exported to Hugging Face."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist_worker import run_trainer, spawn

TOL = 1e-5
TIED = ["--model.tie_embeddings", "true"]
MOE = ["--model.n_experts", "4", "--model.n_experts_per_token", "2", "--model.moe_ffn_dim",
       "64", "--model.moe_aux_loss_coef", "0.01", "--model.moe_bias_update_rate", "0.01"]


@pytest.mark.distributed
def test_save_in_one_layout_resume_in_another(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ref_dp = run_trainer([str(tmp_path / "ref-a"), str(cache), "--training.micro_batch_size",
                          "8"], 4, capture=False)
    ref_ga = run_trainer([str(tmp_path / "ref-b"), str(cache),
                          "--training.grad_accum_steps", "2"], 4, capture=False)
    ref_tied = run_trainer([str(tmp_path / "ref-t"), str(cache), *TIED,
                            "--training.micro_batch_size", "8"], 4, capture=False)
    ref_moe = run_trainer([str(tmp_path / "ref-m"), str(cache), *MOE,
                           "--training.micro_batch_size", "8"], 4, capture=False)
    a, b, c, d, e, f = (str(tmp_path / f"run-{x}") for x in "abcdef")
    jobs = [
        # FSDP (ZeRO-3) over 2 ranks -> DDP over 2 ranks (sharded -> replicated).
        ("fsdp-save", [a, str(cache), "--parallel.data_parallel", "zero3",
                       "--training.steps", "4"], {"save": True}),
        ("ddp-resume", [a, str(cache), "--parallel.data_parallel", "ddp",
                        "--checkpoint.resume", "true", "--training.steps", "4"]),
        # TP x SP over 2 ranks -> 2 pipeline stages (tensor-sharded -> stage-split).
        ("tp-save", [b, str(cache), "--parallel.tp", "2", "--training.grad_accum_steps", "2",
                     "--training.steps", "4"], {"save": True}),
        ("pp-resume", [b, str(cache), "--parallel.pp", "2", "--training.grad_accum_steps", "2",
                       "--checkpoint.resume", "true", "--training.steps", "4"]),
        # DDP over 2 ranks with accumulation -> TP over 2 ranks (one data-parallel rank):
        # the same global batches (2 x 2 x 2 rows, then 4 x 2), the loader's position carried.
        ("ddp-ga-save", [f, str(cache), "--parallel.data_parallel", "ddp",
                         "--training.micro_batch_size", "2", "--training.grad_accum_steps", "2",
                         "--training.steps", "4"], {"save": True}),
        ("tp-ga-resume", [f, str(cache), "--parallel.tp", "2", "--training.grad_accum_steps",
                          "2", "--checkpoint.resume", "true", "--training.steps", "4"]),
        # ZeRO-1: each rank writes the optimizer state of the parameters it owns.
        ("zero1-save", [c, str(cache), "--parallel.data_parallel", "zero1",
                        "--training.steps", "4"], {"save": True}),
        ("zero1-resume", [c, str(cache), "--parallel.data_parallel", "zero1",
                          "--checkpoint.resume", "true", "--training.steps", "4"]),
        # Tied embedding/head under ZeRO-3 (resumed in one process below).
        ("tied-save", [d, str(cache), *TIED, "--parallel.data_parallel", "zero3",
                       "--training.steps", "4"], {"save": True}),
        # Experts sharded over 2 expert-parallel ranks (resumed in one process below).
        ("ep-save", [e, str(cache), *MOE, "--parallel.ep", "2", "--training.steps", "4"],
         {"save": True}),
    ]
    result = spawn(2, jobs, 2, tmp_path)
    r0 = result[0]
    for name, ref in (("ddp-resume", ref_dp), ("pp-resume", ref_ga), ("zero1-resume", ref_dp),
                      ("ddp-ga-save", ref_ga), ("tp-ga-resume", ref_ga)):
        resumed = r0[name]["losses"]
        assert len(resumed) == 2
        part = ref["losses"][:2] if name.endswith("-save") else ref["losses"][2:]
        diff = max(abs(x - y) for x, y in zip(resumed, part, strict=True))
        assert diff <= TOL, (name, resumed, ref["losses"])

    # The ZeRO-3 checkpoint of 2 ranks (mbs 4) continues in one process (mbs 8): the same global
    # batches, as the loader's state is a position in the global sample order (DP 2 -> 1).
    solo = run_trainer([a, str(cache), "--checkpoint.resume", "true", "--training.steps", "4",
                        "--training.micro_batch_size", "8"], 2, capture=False)
    diff = max(abs(x - y) for x, y in zip(solo["losses"], ref_dp["losses"][2:], strict=True))
    assert diff <= TOL, (solo["losses"], ref_dp["losses"])
    # ZeRO-1's partitioned optimizer state (each entry written by its owner) in one process.
    zsolo = run_trainer([c, str(cache), "--checkpoint.resume", "true", "--training.steps", "4",
                         "--training.micro_batch_size", "8"], 2, capture=False)
    diff = max(abs(x - y) for x, y in zip(zsolo["losses"], ref_dp["losses"][2:], strict=True))
    assert diff <= TOL, (zsolo["losses"], ref_dp["losses"])
    tied = run_trainer([d, str(cache), *TIED, "--checkpoint.resume", "true", "--training.steps",
                        "4", "--training.micro_batch_size", "8"], 2, capture=False)
    diff = max(abs(x - y) for x, y in zip(tied["losses"], ref_tied["losses"][2:], strict=True))
    assert diff <= TOL, (tied["losses"], ref_tied["losses"])

    # Expert parallelism 2 -> 1: the experts (and the routing biases) reshard.
    moe = run_trainer([e, str(cache), *MOE, "--checkpoint.resume", "true", "--training.steps",
                       "4", "--training.micro_batch_size", "8"], 2, capture=False)
    diff = max(abs(x - y) for x, y in zip(moe["losses"], ref_moe["losses"][2:], strict=True))
    assert diff <= TOL, (moe["losses"], ref_moe["losses"])

    # One process reads the FSDP checkpoint (its manifest verified): the same weights the
    # ranks held.
    from scaletrain.checkpoint.native_format import load_model_checkpoint

    assert (Path(r0["fsdp-save"]["checkpoint"]) / "manifest.json").is_file()

    model = load_model_checkpoint(r0["fsdp-save"]["checkpoint"])[0]
    state = model.state_dict()
    for key, value in r0["fsdp-save"]["params"].items():
        assert torch.equal(state[key], value), key

    # ... and exports it to Hugging Face safetensors.
    from scaletrain.cli import main

    out = tmp_path / "hf"
    assert main(["convert", r0["fsdp-save"]["checkpoint"], str(out), "--to", "hf"]) == 0
    assert list(out.glob("*.safetensors"))


@pytest.mark.distributed
def test_ep_x_tp_checkpoint_reshards(tmp_path: Path) -> None:
    """Expert x tensor parallelism (experts [Shard(0), Shard(0)] over (ep, tp), attention
    tensor parallel, FSDP over dp_shard) saved after 2 steps resumes as TP x FSDP (experts over
    tp only) and in one process, both continuing the uninterrupted single-process run."""
    cache = tmp_path / "cache"
    ref = run_trainer([str(tmp_path / "ref"), str(cache), *MOE, "--training.micro_batch_size",
                       "8"], 4, capture=False)
    run = str(tmp_path / "run")
    jobs = [
        ("ep-x-tp-save", [run, str(cache), *MOE, "--parallel.ep", "2", "--parallel.tp", "2",
                          "--training.steps", "4"], {"save": True}),
        ("tp-resume", [run, str(cache), *MOE, "--parallel.tp", "2", "--checkpoint.resume",
                       "true", "--training.steps", "4"]),
    ]
    result = spawn(4, jobs, 2, tmp_path)
    saved = result[0]["ep-x-tp-save"]["losses"]
    assert max(abs(x - y) for x, y in zip(saved, ref["losses"][:2], strict=True)) <= TOL
    resumed = result[0]["tp-resume"]["losses"]
    diff = max(abs(x - y) for x, y in zip(resumed, ref["losses"][2:], strict=True))
    assert diff <= TOL, (resumed, ref["losses"])
    solo = run_trainer([run, str(cache), *MOE, "--checkpoint.resume", "true", "--training.steps",
                        "4", "--training.micro_batch_size", "8"], 2, capture=False)
    diff = max(abs(x - y) for x, y in zip(solo["losses"], ref["losses"][2:], strict=True))
    assert diff <= TOL, (solo["losses"], ref["losses"])
    # The full expert tensors the 4 ranks gathered are those one process holds after loading.
    from scaletrain.checkpoint.native_format import load_model_checkpoint

    model = load_model_checkpoint(result[0]["ep-x-tp-save"]["checkpoint"])[0]
    state = model.state_dict()
    experts = [k for k in result[0]["ep-x-tp-save"]["params"] if ".experts." in k]
    assert experts
    for key in experts:
        assert torch.equal(state[key], result[0]["ep-x-tp-save"]["params"][key]), key
