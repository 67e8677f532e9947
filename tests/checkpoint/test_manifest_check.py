"""A manifest (native meta.json, Hugging Face config.json) whose sizes the stored tensors do not
have, through every verb that loads a model: exit 2, one line naming the file, the field, its
value and what the tensors say; nothing written; refused before any model is built (a
`n_layers` of 10^7 used to build blocks for hours, a `vocab_size` of 10^12 to ask the allocator
for terabytes)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scaletrain.checkpoint.integrity import MANIFEST_NAME, write_manifest
from scaletrain.cli import main
from tests.helpers.finetune import qa_records, write_jsonl
from tests.helpers.synth import tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
GUARD_S = 60  # a refusal takes milliseconds; a believed manifest ran for hours
# (field in meta.json's model_args, config.json key, absurd or mismatched value)
DAMAGES = {
    "layers": ("n_layers", "num_hidden_layers", 10**7),
    "vocab": ("vocab_size", "vocab_size", 10**12),
    "hidden": ("dim", "hidden_size", 96),
}
SECONDS: dict[str, float] = {}


@contextlib.contextmanager
def hang_guard(seconds: int = GUARD_S) -> Iterator[None]:
    """Fail (instead of running for hours) when the block does not return in time."""
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"no answer within {seconds} s: the manifest was believed")

    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny native checkpoint (tokenizer inside) and the same model as a HF folder."""
    from scaletrain.checkpoint.native_format import load_model_checkpoint
    from scaletrain.models.hf import save_hf_checkpoint

    root = tmp_path_factory.mktemp("bases")
    native = tiny_checkpoint(root / "native")
    model, _, tok = load_model_checkpoint(native)
    hf = save_hf_checkpoint(model, root / "hf", tokenizer_file=tok, eos_token_id=1)
    return {"native": native, "hf": hf}


@pytest.fixture(scope="module")
def finetuned(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    """A one-step LoRA fine-tune of each base (what `predict` reads)."""
    root = tmp_path_factory.mktemp("ft")
    data = write_jsonl(root / "sft.jsonl", qa_records(16))
    out = {}
    for fmt, base in bases.items():
        out[fmt] = root / fmt
        assert main(["finetune", "--base", str(base), "--data", str(data), "--output",
                     str(out[fmt]), "--method", "lora", "--training.steps", "1",
                     "--training.micro_batch_size", "2", "--data.seq_len", "128",
                     "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"]) == 0
    return out


def damage(directory: Path, fmt: str, kind: str) -> tuple[str, str]:
    """Write the damaged size into the manifest (a consistent hash manifest, as a forger would
    leave it); returns (manifest file name, the field as the message names it)."""
    field, hf_key, value = DAMAGES[kind]
    if fmt == "native":
        meta = json.loads((directory / "meta.json").read_text())
        meta["model_args"][field] = value
        (directory / "meta.json").write_text(json.dumps(meta))
        (directory / MANIFEST_NAME).unlink()
        write_manifest(directory)
        return "meta.json", f"model_args.{field} is {value}"
    cfg = json.loads((directory / "config.json").read_text())
    cfg[hf_key] = value
    (directory / "config.json").write_text(json.dumps(cfg))
    return "config.json", f"{hf_key} is {value}"


def _argv(verb: str, model: Path, tmp: Path) -> list[str]:
    if verb == "generate":
        return ["generate", "--checkpoint", str(model), "--prompt-ids", "1,2",
                "--max-new-tokens", "1"]
    if verb == "serve":
        return ["serve", "--checkpoint", str(model), "--port", "0"]
    if verb == "convert":
        return ["convert", str(model), str(tmp / "converted"), "--to", "hf"]
    if verb == "eval":
        (tmp / "tasks").mkdir()
        return ["eval", "--checkpoint", str(model), "--tasks", "anything", "--include-path",
                str(tmp / "tasks"), "--output", str(tmp / "results.json")]
    if verb == "predict":
        return ["predict", "--checkpoint", str(model), "--text", "what color is it ?"]
    if verb.startswith("finetune"):
        data = write_jsonl(tmp / "sft.jsonl", qa_records(8))
        dry = ["--dry-run"] if verb == "finetune-dry-run" else []
        return ["finetune", *dry, "--base", str(model), "--data", str(data), "--output",
                str(tmp / "ft"), "--training.steps", "1", "--metrics.tensorboard", "false",
                "--metrics.progress_bar", "false"]
    assert verb == "synth"
    return ["data", "synth", "--checkpoint", str(model), "--topics", "rain", "--out",
            str(tmp / "synth"), "--num-prompts", "1", "--judge", "none"]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused(run: Callable[[], int], capfd: pytest.CaptureFixture[str], named: str,
             field_text: str, key: str) -> None:
    capfd.readouterr()
    t0 = time.perf_counter()
    with hang_guard():
        rc = run()
    SECONDS[key] = time.perf_counter() - t0
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert named in lines[0] and field_text in lines[0], lines[0]
    assert "Traceback" not in err


VERBS = ["generate", "serve", "convert", "eval", "finetune", "finetune-dry-run", "synth",
         "predict"]


@pytest.mark.parametrize("kind", sorted(DAMAGES))
@pytest.mark.parametrize("fmt", ["native", "hf"])
@pytest.mark.parametrize("verb", VERBS)
def test_bad_manifest_is_refused_before_anything_is_built(
        verb: str, fmt: str, kind: str, bases: dict[str, Path], tmp_path: Path,
        request: pytest.FixtureRequest, capfd: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base"
    shutil.copytree(bases[fmt], base)
    model = base
    if verb == "predict":  # the fine-tune's finetune.json points at the damaged base copy
        model = tmp_path / "ft-run"
        shutil.copytree(request.getfixturevalue("finetuned")[fmt], model)
        meta = json.loads((model / "finetune.json").read_text())
        meta["base"] = meta["base_checkpoint"] = str(base.resolve())
        (model / "finetune.json").write_text(json.dumps(meta))
    named, field_text = damage(base, fmt, kind)
    argv = _argv(verb, model, tmp_path)
    before = _files(tmp_path)
    _refused(lambda: main(argv), capfd, named, field_text, f"{verb}/{fmt}/{kind}")
    assert _files(tmp_path) == before  # nothing written, not even a temporary directory


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_train_resume_refuses_a_manifest_of_another_model(
        kind: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Resume builds the model of the run's config, never the manifest's; a manifest that
    disagrees is refused before a step runs."""
    from scaletrain.train.trainer import Trainer
    from tests.helpers.trainer import tiny_argv, tiny_config

    cache = tmp_path_factory.getbasetemp() / "manifest-cache"
    run = tmp_path / "run"
    Trainer(tiny_config(run, cache, "--training.steps", "1")).train()
    ckpt = next((run / "checkpoints").glob("step-*"))
    named, field_text = damage(ckpt, "native", kind)
    before = _files(tmp_path)
    argv = ["train", *tiny_argv(run, cache, "--training.steps", "2",
                                "--checkpoint.resume", "true",
                                "--checkpoint.allow_schedule_change", "true")]
    _refused(lambda: main(argv), capfd, named, DAMAGES[kind][0], f"train/{kind}")
    assert _files(tmp_path) == before


def test_mismatched_ffn_size_names_the_field(bases: dict[str, Path], tmp_path: Path) -> None:
    from scaletrain.checkpoint.integrity import CheckpointError
    from scaletrain.checkpoint.native_format import load_model_checkpoint

    base = tmp_path / "native"
    shutil.copytree(bases["native"], base)
    meta = json.loads((base / "meta.json").read_text())
    meta["model_args"]["ffn_dim"] = 4096
    (base / "meta.json").write_text(json.dumps(meta))
    (base / MANIFEST_NAME).unlink()
    write_manifest(base)
    with pytest.raises(CheckpointError, match=r"model_args.ffn_dim is 4096 but .metadata "
                                              r"stores layers.0.feed_forward.w1.weight as "
                                              r"\[256, 64\] \(the manifest's sizes give "
                                              r"\[4096, 64\]\)"):
        load_model_checkpoint(base)


def test_good_checkpoints_still_load(bases: dict[str, Path]) -> None:
    """The checks pass good checkpoints (transformers-written GPT-2, MoE, sharded and tied
    ones load through the same check in test_hf_interop.py and test_hf_moe.py)."""
    from scaletrain.inference.loader import load_model, model_args_of

    for path in bases.values():
        loaded = load_model(path)
        assert model_args_of(path) == loaded.args


def test_cli_refusal_is_quick_and_quiet_in_a_subprocess(bases: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """The issue's report, as a user runs it: `convert` of a 10^7-layer manifest."""
    import os

    base = tmp_path / "hf"
    shutil.copytree(bases["hf"], base)
    damage(base, "hf", "layers")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "convert", str(base),
                           str(tmp_path / "out"), "--to", "native"], capture_output=True,
                          text=True, timeout=300, env=env)
    wall = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "num_hidden_layers is 10000000" in lines[0], proc.stderr
    assert "holds 2 layers (0-1)" in lines[0]
    assert not (tmp_path / "out").exists()
    print(f"convert refused a 10^7-layer config.json in {wall:.2f} s (process start included)")


def teardown_module() -> None:
    if SECONDS:
        worst = max(SECONDS, key=SECONDS.__getitem__)
        print(f"\n{len(SECONDS)} refusals; slowest {worst}: {SECONDS[worst]:.2f} s "
              "(in-process, verb start-up included)")


def _transformers_checkpoint(family: str, path: Path) -> Path:
    """A tiny checkpoint written by transformers itself (the independent reference)."""
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                      n_positions=96)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    elif family == "phi3":  # fused qkv_proj and gate_up_proj, split by the check on meta
        from tests.helpers.family import COMMON

        cfg = transformers.Phi3Config(**{**COMMON, "num_key_value_heads": 4})
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    else:
        from tests.helpers.moe_hf import hf_moe_model

        hf_moe_model(family).save_pretrained(path)
    return path


@pytest.mark.parametrize(("family", "key", "value", "says"), [
    ("gpt2", "n_layer", 10**7, "holds 2 layers (0-1)"),
    ("gpt2", "n_positions", 10**9, "stores 96 position embeddings"),
    ("gpt2", "n_embd", 96, "stores the embedding with width 64"),
    ("phi3", "intermediate_size", 4096, "model.safetensors does not hold the model it "
                                        "describes: layer 0: fused tensor of 192 rows, the config "
                                        "says 8192 (4096 + 4096)"),
    ("mixtral", "num_local_experts", 10**9, "holds tensors of 4 experts"),
    ("qwen3_moe", "moe_intermediate_size", 4096, "stores layers.0.feed_forward.experts.w1 as "
                                                 "[4, 40, 64]"),
])
def test_family_sizes_are_named_by_their_config_key(family: str, key: str, value: int,
                                                    says: str, tmp_path: Path) -> None:
    from scaletrain.models.hf import hf_model_args
    from scaletrain.models.stored_shapes import ManifestMismatch

    path = _transformers_checkpoint(family, tmp_path / family)
    hf_model_args(path)  # as transformers wrote it: accepted
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with hang_guard(), pytest.raises(ManifestMismatch) as caught:
        hf_model_args(path)
    message = str(caught.value)
    assert message.startswith(f"{path / 'config.json'}: "), message
    assert says in message, message
    if family != "phi3":  # the fused tensors say which rows they hold instead
        assert message.startswith(f"{path / 'config.json'}: {key} is {value} but "), message
