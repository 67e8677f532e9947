from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from scaletrain.train.trainer import Trainer, TrainingDiverged
from tests.helpers.trainer import tiny_config

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device",
               "tflops", "mfu", "peak_mem_gib", "mem_baseline_gib", "step_time_s", "data_wait_s"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


def _capture_grads(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Record the gradients the optimizer sees at each step."""
    seen: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step
    names = {id(p): n for n, p in trainer.model.state_dict(keep_vars=True).items()}

    def recording_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({names[id(p)]: p.grad.clone() for p in trainer.model.parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step  # type: ignore[method-assign]
    return seen


def test_accumulation_matches_one_large_batch(tmp_path: Path, cache: Path) -> None:
    big = Trainer(tiny_config(tmp_path / "a", cache, "--training.micro_batch_size", "8"))
    small = Trainer(tiny_config(tmp_path / "b", cache, "--training.micro_batch_size", "2",
                                "--training.grad_accum_steps", "4"))
    big_grads, small_grads = _capture_grads(big), _capture_grads(small)
    for _ in range(2):
        (x, y), = big.next_batches()
        loss_big, norm_big = big.train_step([(x, y)])
        loss_small, norm_small = small.train_step(
            [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]
        )
        assert loss_small == pytest.approx(loss_big, rel=1e-6)
        assert norm_small == pytest.approx(norm_big, rel=1e-5)
    for g_big, g_small in zip(big_grads, small_grads, strict=True):
        for name in g_big:
            # atol: fp32 summation-order noise on near-cancelling elements (data-dependent)
            torch.testing.assert_close(g_small[name], g_big[name], rtol=1e-5, atol=5e-7)


def test_accumulation_counts_valid_tokens_globally(tmp_path: Path, cache: Path) -> None:
    """Micro-batches with different numbers of valid tokens still weigh every token equally."""
    t = Trainer(tiny_config(tmp_path / "m", cache, "--training.micro_batch_size", "4"))
    (x, y), = t.next_batches()
    y = y.clone()
    y[:2, 5:] = -100  # first half has far fewer valid tokens
    grads = _capture_grads(t)
    loss_one, _ = t.train_step([(x, y)])
    u = Trainer(tiny_config(tmp_path / "n", cache, "--training.micro_batch_size", "2",
                            "--training.grad_accum_steps", "2"))
    grads_u = _capture_grads(u)
    loss_two, _ = u.train_step([(x[:2], y[:2]), (x[2:], y[2:])])
    assert loss_two == pytest.approx(loss_one, rel=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads_u[0][name], grads[0][name], rtol=1e-5, atol=1e-7)


def _tiny_params(args):  # type: ignore[no-untyped-def]
    """Every parameter by name, a tied head listed as `output.weight` too."""
    from scaletrain.models.transformer import empty_model

    return empty_model(args, "meta").named_parameters(remove_duplicate=False)


def test_training_writes_metrics_and_learns(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "run"
    result = Trainer(tiny_config(out, cache, "--training.steps", "12",
                                 "--optimizer.lr", "1e-2")).train()
    assert result.steps == 12
    assert result.losses[-1] < result.losses[0] - 0.5
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 13))
    assert all(set(m) == METRIC_KEYS for m in lines)
    assert lines[0]["mfu"] is None  # CPU: no peak-FLOPS entry
    # The job's tokens of a step are the global batch x sequence length (4 x 32), and the
    # model FLOPs per token 6N + 12 L H Q T, N every parameter but the embedding lookup
    # (torchtitan's convention: norm weights count, a tied head counts as the head).
    args = tiny_config(out, cache).model.to_model_args()
    n_matmul = sum(p.numel() for name, p in _tiny_params(args) if name != "tok_embeddings.weight")
    flops = 6 * n_matmul + 12 * args.n_layers * args.n_heads * args.head_dim * 32
    for m in lines:
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(4 * 32, rel=1e-9)
        assert m["tflops"] * 1e12 == pytest.approx(m["tokens_per_s_per_device"] * flops,
                                                   rel=1e-9)
    assert result.tokens_seen == 12 * 4 * 32
    # One process: the job is the device; memory is reported above the pre-model baseline.
    assert all(m["tokens_per_s_per_device"] == m["tokens_per_s"] for m in lines)
    assert all(0 < m["peak_mem_gib"] < m["mem_baseline_gib"] for m in lines)  # a tiny model
    assert math.isfinite(result.val_loss)
    assert (out / "config.toml").is_file()
    assert result.checkpoint is not None and (result.checkpoint / "meta.json").is_file()


@pytest.mark.parametrize("extra", [(), ("--optimizer.offload", "true"),
                                   ("--precision.dtype", "fp16", "--training.grad_accum_steps",
                                    "2", "--training.micro_batch_size", "2")],
                         ids=["plain", "offload", "fp16-ga2"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, cache: Path,
                                                 extra: tuple[str, ...]) -> None:
    out = tmp_path / "run"
    argv = ("--training.steps", "6", "--checkpoint.interval", "3", "--checkpoint.keep_last", "5",
            *extra)
    straight = Trainer(tiny_config(out, cache, *argv))
    full = straight.train()
    ckpts = sorted((out / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-0000003", "step-0000006"]
    # Pretend the run died after step 5: only the step-3 checkpoint survived.
    import shutil

    shutil.rmtree(ckpts[-1])
    resumed = Trainer(tiny_config(out, cache, *argv, "--checkpoint.resume", "true"))
    assert resumed.step == 3
    result = resumed.train()
    assert result.losses == full.losses[3:]  # bitwise equal on CPU
    assert result.tokens_seen == full.tokens_seen == 6 * 4 * 32  # earlier steps included
    if straight.scaler is not None:  # fp16: the loss scaler's state (scale, growth tracker)
        assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_interval_saves_the_last_step_without_save_final(tmp_path: Path, cache: Path) -> None:
    """`checkpoint.interval N` saves every N-th step, the last one included when `save_final`
    is off (save_final adds the last step when N does not divide it)."""
    out = tmp_path / "run"
    Trainer(tiny_config(out, cache, "--checkpoint.interval", "2", "--checkpoint.keep_last", "5",
                        "--checkpoint.save_final", "false")).train()
    assert [c.name for c in sorted((out / "checkpoints").iterdir())] == ["step-0000002",
                                                                         "step-0000004"]
    Trainer(tiny_config(tmp_path / "odd", cache, "--checkpoint.interval", "3",
                        "--checkpoint.save_final", "false")).train()
    assert [c.name for c in (tmp_path / "odd" / "checkpoints").iterdir()] == ["step-0000003"]


def test_resume_without_checkpoint_is_a_clear_error(tmp_path: Path, cache: Path) -> None:
    from scaletrain.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        Trainer(tiny_config(tmp_path / "x", cache, "--checkpoint.resume", "true"))


def test_damaged_checkpoint_is_a_clear_error(tmp_path: Path, cache: Path) -> None:
    from scaletrain.train.checkpoint import CheckpointError

    out = tmp_path / "run"
    Trainer(tiny_config(out, cache, "--training.steps", "2")).train()
    ckpt = out / "checkpoints" / "step-0000002"
    for f in ckpt.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="damaged"):
        Trainer(tiny_config(out, cache, "--training.steps", "2", "--checkpoint.resume", "true"))


@pytest.mark.parametrize(
    "extra",
    [
        ("--precision.dtype", "bf16"),
        ("--precision.dtype", "fp16"),
        ("--precision.dtype", "bf16", "--precision.param_dtype", "bf16"),
        ("--optimizer.offload", "true"),
        ("--optimizer.name", "sgd", "--optimizer.lr", "0.05"),
        ("--optimizer.name", "adafactor", "--optimizer.lr", "0.01"),
        ("--optimizer.name", "adamw8bit"),
        ("--optimizer.implementation", "foreach"),
        ("--lr_schedule.decay", "wsd"),
        ("--activation_checkpoint.mode", "full"),
    ],
    ids=lambda e: "-".join(x.split(".")[-1] for x in e),
)
def test_techniques_train(tmp_path: Path, cache: Path, extra: tuple[str, ...]) -> None:
    if "adamw8bit" in extra:
        pytest.importorskip("bitsandbytes")
    result = Trainer(tiny_config(tmp_path / "r", cache, "--training.steps", "8",
                                 "--optimizer.lr", "1e-2", *extra)).train()
    assert all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0]


def test_low_precision_close_to_fp32(tmp_path: Path, cache: Path) -> None:
    ref = Trainer(tiny_config(tmp_path / "a", cache))
    (x, y), = ref.next_batches()
    loss32, _ = ref.train_step([(x, y)])
    for dtype in ("bf16", "fp16"):
        t = Trainer(tiny_config(tmp_path / dtype, cache, "--precision.dtype", dtype))
        loss, _ = t.train_step([(x, y)])
        assert loss == pytest.approx(loss32, abs=2e-2), dtype
        assert loss != loss32  # autocast really ran in lower precision


def test_offload_matches_plain_fp32(tmp_path: Path, cache: Path) -> None:
    a = Trainer(tiny_config(tmp_path / "a", cache)).train()
    b = Trainer(tiny_config(tmp_path / "b", cache, "--optimizer.offload", "true")).train()
    assert b.losses == pytest.approx(a.losses, rel=1e-6)


def test_nan_loss_stops_or_skips(tmp_path: Path, cache: Path) -> None:
    t = Trainer(tiny_config(tmp_path / "s", cache))
    t.loss_fn = lambda logits, y: logits.sum() * float("nan")
    with pytest.raises(TrainingDiverged, match="step 1"):
        t.train_step(t.next_batches())
    t = Trainer(tiny_config(tmp_path / "k", cache, "--training.on_nan", "skip"))
    before = {n: p.clone() for n, p in t.model.named_parameters()}
    t.loss_fn = lambda logits, y: logits.sum() * float("nan")
    loss, _ = t.train_step(t.next_batches())
    assert math.isnan(loss)
    assert all(torch.equal(p, before[n]) for n, p in t.model.named_parameters())


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path: Path, cache: Path) -> None:
    eager = Trainer(tiny_config(tmp_path / "e", cache, "--training.steps", "2")).train()
    compiled = Trainer(tiny_config(tmp_path / "c", cache, "--training.steps", "2",
                                   "--compile.enabled", "true")).train()
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)


def test_cli_train_smoke(tmp_path: Path, cache: Path) -> None:
    """`scaletrain train` end to end: metrics, TensorBoard, checkpoint, then a resume."""
    from scaletrain.cli import main
    from tests.helpers.trainer import tiny_argv

    out = tmp_path / "cli"
    argv = tiny_argv(out, cache, "--metrics.tensorboard", "true", "--training.sample_tokens", "4")
    assert main(["train", *argv]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert any((out / "tb").iterdir())
    assert (out / "checkpoints" / "step-0000004" / "meta.json").is_file()
    more = [*argv, "--training.steps", "6", "--checkpoint.resume", "true",
            "--checkpoint.allow_schedule_change", "true"]  # extends the finished schedule
    assert main(["train", *more]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


def test_moe_training_logs_expert_load_and_moves_the_bias(tmp_path: Path, cache: Path) -> None:
    """A MoE run: the aux loss and the balancing bias run through the step; at each log step
    metrics.jsonl gets each layer's tokens per expert over the interval (tokens x k)."""
    out = tmp_path / "moe"
    trainer = Trainer(tiny_config(
        out, cache, "--model.n_experts", "4", "--model.n_experts_per_token", "2",
        "--model.moe_ffn_dim", "64", "--model.moe_aux_loss_coef", "0.01",
        "--model.moe_bias_update_rate", "0.01", "--metrics.log_interval", "2",
        "--training.grad_accum_steps", "2", "--training.max_grad_norm", "1.0"))
    result = trainer.train()
    assert result.steps == 4 and all(math.isfinite(x) for x in result.losses)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in lines if "moe" in m]
    assert [m["step"] for m in logged] == [1, 2, 4]  # the first step is logged alone
    for m, steps in zip(logged, [1, 1, 2], strict=True):
        assert set(m["moe"]["layers"]) == {"layers.0.feed_forward", "layers.1.feed_forward"}
        for layer in m["moe"]["layers"].values():
            # steps in the interval x accumulation x micro-batch x seq x k
            assert sum(layer["tokens_per_expert"]) == steps * 2 * 4 * 32 * 2
            assert layer["load_max_over_mean"] >= 1.0
            assert layer["aux_loss"] > 0 and layer["router_entropy"] > 0
    biases = [m.router.expert_bias for m in trainer.model.modules() if hasattr(m, "router")]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # moved by the balancing updates
