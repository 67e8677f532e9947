"""Fine-tuning end to end on the Trainer, from a tiny model pretrained in a session fixture:
classification accuracy, resume for every method, PEFT interop, merge/convert/generate, errors.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.commands import convert as convert_cmd
from scaletrain.commands import finetune as finetune_cmd
from scaletrain.commands import generate as generate_cmd
from scaletrain.commands import predict as predict_cmd
from scaletrain.config import load_config
from scaletrain.finetune.base import FinetuneError, load_base
from scaletrain.finetune.loading import load_finetuned
from scaletrain.finetune.trainer import FinetuneTrainer
from scaletrain.plan.flops import flops_per_token
from scaletrain.train.trainer import Trainer
from tests.helpers.finetune import corpus_dir, qa_records, sentiment_records, write_jsonl
from tests.helpers.trainer import tiny_config

QUIET = ["--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
         "--metrics.log_interval", "50", "--precision.dtype", "fp32"]


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (dim 64, 2 blocks, 443-token BPE) pretrained for 60 steps on the words the
    tasks use (a run directory), the same as a HF directory, and the task files."""
    root = tmp_path_factory.mktemp("finetune")
    corpus = corpus_dir(root / "corpus")
    cfg = tiny_config(root / "pre", root / "cache", "--data.dataset", "text_dir",
                      "--data.path", str(corpus), "--data.file_glob", "*.txt",
                      "--training.steps", "60", "--data.seq_len", "64",
                      "--optimizer.lr", "3e-3", "--lr_schedule.warmup_steps", "5")
    Trainer(cfg).train()
    assert convert_cmd.main([str(root / "pre"), str(root / "hf"), "--to", "hf"]) == 0
    return {
        "native": root / "pre", "hf": root / "hf",
        "cls": write_jsonl(root / "cls.jsonl", sentiment_records(240)),
        "sft": write_jsonl(root / "sft.jsonl", qa_records(96)),
    }


def ft_argv(output: Path, base: Path, data: Path, method: str, task: str, *extra: str) -> list[str]:
    return ["--config", "finetune", "--output", str(output), "--finetune.base", str(base),
            "--finetune.data", str(data), "--finetune.method", method, "--finetune.task", task,
            "--data.seq_len", "64", "--training.micro_batch_size", "8",
            "--training.eval_interval", "0", "--lr_schedule.warmup_steps", "2",
            "--finetune.lora_rank", "4", *QUIET, *extra]


def run_ft(*argv_parts: object) -> FinetuneTrainer:
    trainer = FinetuneTrainer(load_config(ft_argv(*argv_parts), prog="scaletrain finetune"))
    trainer.train()
    return trainer


def test_classification_from_pretrained_reaches_high_validation_accuracy(
        bases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cls"
    trainer = run_ft(out, bases["native"], bases["cls"], "lora", "classification",
                     "--training.steps", "30", "--optimizer.lr", "3e-3",
                     "--data.val_fraction", "0.25", "--data.seq_len", "32")
    assert len(trainer.val_data) == 60  # a held-out quarter of the 240 examples
    assert trainer.labels == ["negative", "neutral", "positive"]
    assert trainer.last_scores["accuracy"] >= 0.95
    assert trainer.last_scores["macro_f1"] >= 0.95
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    texts = ["the hotel was superb and i would go again", "this book was dreadful and i would "
             "not go again", "the game was shown at noon to the public"]
    argv = ["--checkpoint", str(out), "--json"]
    for t in texts:
        argv += ["--text", t]
    assert predict_cmd.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["label"] for r in rows] == ["positive", "negative", "neutral"]


@pytest.mark.parametrize("method", ["full", "freeze", "lora", "qlora"])
def test_resume_reproduces_the_uninterrupted_run(method: str, bases: dict[str, Path],
                                                 tmp_path: Path) -> None:
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    # accumulation and the default clipping on; LoRA's dropout draws from the RNG, whose
    # state the checkpoint must carry (and nothing else may draw from after loading it)
    extra = ["--optimizer.lr", "2e-3", "--checkpoint.interval", "2",
             "--training.grad_accum_steps", "2", "--training.micro_batch_size", "4"]
    if method in ("lora", "qlora"):
        extra += ["--finetune.lora_dropout", "0.1"]
    if method == "freeze":
        extra += ["--finetune.freeze_first", "1"]
    straight = run_ft(tmp_path / "a", bases["native"], bases["sft"], method, "sft",
                      "--training.steps", "4", *extra)
    run_ft(tmp_path / "b", bases["native"], bases["sft"], method, "sft", "--training.steps", "2",
           *extra)
    resumed = run_ft(tmp_path / "b", bases["native"], bases["sft"], method, "sft",
                     "--training.steps", "4", "--checkpoint.resume", "true", *extra)
    assert resumed.step == 4
    a = {k: v for k, v in straight.model.state_dict().items() if "lora_" in k or
         method in ("full", "freeze")}
    b = resumed.model.state_dict()
    assert a
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, atol=1e-6, rtol=0, msg=k)
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines]
    assert losses == pytest.approx(straight_losses(tmp_path / "a"), abs=1e-5)


def straight_losses(output: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (output / "metrics.jsonl").read_text().splitlines()]


def test_resumed_classification_logs_each_step_once(bases: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """classification.jsonl, like metrics.jsonl and eval.jsonl, drops the records past the
    checkpoint a run resumes from (they are written again), and a fresh run starts it anew."""
    out = tmp_path / "cls"
    argv = ("--training.steps", "4", "--training.eval_interval", "2", "--checkpoint.interval",
            "2", "--checkpoint.keep_last", "3", "--data.seq_len", "32")

    def steps(name: str) -> list[int]:
        return [json.loads(x)["step"] for x in (out / name).read_text().splitlines()]

    run_ft(out, bases["native"], bases["cls"], "lora", "classification", *argv)
    assert steps("classification.jsonl") == steps("eval.jsonl") == [2, 4]
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-0000004")  # the run died after step 3
    run_ft(out, bases["native"], bases["cls"], "lora", "classification", *argv,
           "--checkpoint.resume", "true")
    assert steps("classification.jsonl") == steps("eval.jsonl") == [2, 4]
    run_ft(out, bases["native"], bases["cls"], "lora", "classification", *argv,
           "--checkpoint.resume", "false")  # anew
    assert steps("classification.jsonl") == steps("eval.jsonl") == [2, 4]


def test_peft_loads_our_adapter_and_merge_matches(bases: dict[str, Path], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    out = tmp_path / "sft"
    run_ft(out, bases["hf"], bases["sft"], "lora", "sft", "--training.steps", "6",
           "--optimizer.lr", "1e-2", "--finetune.lora_targets", "q,k,v,o,gate,up,down",
           "--finetune.train_norms", "true")
    ours = load_finetuned(out, merge=False).model
    base = load_base(bases["hf"]).model
    assert not torch.equal(ours.norm.weight, base.norm.weight)  # trained norms travel too
    tokens = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 11]])
    with torch.no_grad():
        expected = ours(tokens)
        base_logits = base(tokens)
    assert not torch.allclose(expected, base_logits, atol=1e-3)  # the adapter does something
    hf = transformers.LlamaForCausalLM.from_pretrained(bases["hf"], dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, out / "adapter").eval()
    with torch.no_grad():
        got = peft_model(tokens).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # `convert OUTPUT MERGED --to hf`: the merged weights give the base + adapter logits
    # (written block by block into several shards, as transformers shards)
    assert convert_cmd.main([str(out), str(tmp_path / "merged"), "--to", "hf",
                             "--max-shard-size", "100KB"]) == 0
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, expected, atol=1e-4, rtol=1e-4)


def test_peft_loads_our_classification_adapter(bases: dict[str, Path], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    out = tmp_path / "cls"
    trainer = run_ft(out, bases["hf"], bases["cls"], "lora", "classification",
                     "--training.steps", "3", "--optimizer.lr", "1e-2")
    done = load_finetuned(out, merge=False)
    tokens = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        expected = done.model(tokens, torch.tensor([7]))
    hf = transformers.LlamaForSequenceClassification.from_pretrained(
        bases["hf"], dtype=torch.float32, num_labels=len(trainer.labels),
        pad_token_id=done.base.pad_id)
    model = peft.PeftModel.from_pretrained(hf, out / "adapter").eval()
    with torch.no_grad():
        got = model(tokens).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_generate_uses_base_plus_adapter(bases: dict[str, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from scaletrain.inference.generation import generate

    out = tmp_path / "sft"
    assert finetune_cmd.main(ft_argv(out, bases["native"], bases["sft"], "lora", "sft",
                                     "--training.steps", "4", "--optimizer.lr", "5e-3")) == 0
    prompt = "the film is green. what color is it? "
    capsys.readouterr()
    assert generate_cmd.main(["--checkpoint", str(out), "--prompt", prompt, "--temperature",
                              "0", "--max-new-tokens", "6", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["ids"]
    done = load_finetuned(out)
    ids = done.base.tokenizer.encode(prompt).ids
    assert got == generate(done.model, ids, 6, eos_id=done.base.eos_id)
    # The loader reads the output in a process that never imported scaletrain.finetune: the
    # fine-tuned format comes from the package's entry point (inference/finetuned.py).
    code = ("import sys, scaletrain\n"
            f"m = scaletrain.load_model({str(out)!r})\n"
            f"ids = scaletrain.generate(m.model, {ids!r}, 6, eos_id=m.eos_id)\n"
            "print(ids, m.finetune['method'], 'scaletrain.finetune.loading' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[-2] == f"{got} lora True"
    # Without a registered format the loader says what is missing instead of guessing.
    code = ("import importlib.metadata as md, scaletrain.inference.finetuned as f\n"
            "f.entry_points = lambda group: []\n"
            "from scaletrain.inference.loader import load_model\n"
            f"load_model({str(out)!r})")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode != 0
    assert "no reader of fine-tuned outputs is registered" in res.stderr


def test_bad_inputs_get_clear_messages(bases: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    def fails(*extra: str, data: Path = bases["sft"], task: str = "sft",
              base: Path = bases["native"], method: str = "lora") -> str:
        argv = ft_argv(tmp_path / "bad", base, data, method, task, "--training.steps", "1",
                       *extra)
        assert finetune_cmd.main(argv) == 2
        return capsys.readouterr().err

    assert "'attn' matches no layer" in fails("--finetune.lora_targets", "q,attn")
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "the movie " * 40, "response": "x"}]
                       * 3)
    assert "long.jsonl:1: the example has" in fails(data=long)
    odd = tmp_path / "mamba"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    assert "unsupported Hugging Face model_type 'mamba'" in fails(base=odd)
    # a label set that does not match the head of the run being resumed (the data file was
    # rewritten in place: another path is refused earlier, as a change of the data order)
    data = write_jsonl(tmp_path / "labels.jsonl", sentiment_records(240))
    run_ft(tmp_path / "cls", bases["native"], data, "full", "classification",
           "--training.steps", "1")
    write_jsonl(data, [r for r in sentiment_records(240) if r["label"] != "neutral"])
    with pytest.raises(FinetuneError, match="does not match the head"):
        run_ft(tmp_path / "cls", bases["native"], data, "full", "classification",
               "--training.steps", "2", "--checkpoint.resume", "true",
               "--checkpoint.allow_schedule_change", "true")  # the finished 1-step schedule
    assert "not in the label set" in fails("--finetune.labels", "positive,negative",
                                           data=bases["cls"], task="classification")


def test_default_seq_len_fits_the_base(bases: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from scaletrain.inference.loader import load_model

    short = tmp_path / "short-base"  # the HF base, with a context of 64 positions
    shutil.copytree(bases["hf"], short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    limit = load_model(short).args.max_seq_len
    assert limit == 64  # shorter than the preset's data.seq_len
    out = tmp_path / "fit"
    argv = ["--base", str(short), "--data", str(bases["sft"]), "--method", "lora",
            "--task", "sft", "--output", str(out), "--training.steps", "1",
            "--training.eval_interval", "0", *QUIET]
    assert finetune_cmd.main(argv) == 0
    assert json.loads((out / "finetune.json").read_text())["seq_len"] == limit
    capsys.readouterr()
    too_long = ["--output", str(tmp_path / "long"), *argv[argv.index("--training.steps"):],
                *argv[:8], "--data.seq_len", str(limit + 1)]
    assert finetune_cmd.main(too_long) == 2  # a length the user chose is not changed
    assert "exceeds the base model's max_seq_len" in capsys.readouterr().err


@pytest.mark.parametrize("base,method,task,extra", [
    ("hf", "lora", "sft", ("--finetune.lora_targets", "q,v", "--finetune.train_norms", "true")),
    ("native", "freeze", "classification", ("--finetune.train_last", "1")),
    ("native", "full", "sft", ()),
])
def test_dry_run_equals_the_run(base: str, method: str, task: str, extra: tuple[str, ...],
                                bases: dict[str, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """`finetune --dry-run --json` (no weights read, no model built) gives the parameter counts
    and model-state bytes the built run writes to finetune.json."""
    data = bases["cls" if task == "classification" else "sft"]
    argv = ft_argv(tmp_path / "run", bases[base], data, method, task, *extra)
    assert finetune_cmd.main([*argv, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))  # finetune.json
    meta = json.loads((tmp_path / "run" / "finetune.json").read_text())
    # One FLOP count for the logs' TFLOP/s and MFU and the plan: the matmuls the method runs.
    assert trainer.flops_per_token == pytest.approx(plan["flops_per_token"], rel=1e-12)
    pretraining = flops_per_token(trainer.model_args, trainer.cfg.data.seq_len)
    assert (plan["flops_per_token"] < 0.9 * pretraining) == (method != "full")
    assert (plan["finetune"]["trainable"], plan["finetune"]["total"]) == \
        (meta["params"]["trainable"], meta["params"]["total"])
    mem, built = plan["memory_bytes"], meta["memory_bytes"]
    assert mem["weights"] == built["frozen_weights"] + built["trainable_weights"]
    assert mem["gradients"] == built["gradients"]
    assert mem["optimizer"] == built["optimizer_state"]


def test_dry_run_refuses_what_the_run_refuses(bases: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    short = tmp_path / "short-base"  # the HF base with a context of 48 positions
    shutil.copytree(bases["hf"], short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 48}))
    long_argv = ft_argv(tmp_path / "run", short, bases["sft"], "lora", "sft")
    assert finetune_cmd.main([*long_argv, "--dry-run"]) == 2  # ft_argv's seq_len is 64
    assert "exceeds the base model's max_seq_len" in capsys.readouterr().err
    argv = ft_argv(tmp_path / "run", bases["hf"], bases["sft"], "lora", "sft")
    assert finetune_cmd.main([*argv, "--finetune.train_biases", "true", "--dry-run"]) == 2
    assert "train_biases is not supported" in capsys.readouterr().err
    classify = ft_argv(tmp_path / "run", bases["hf"], bases["cls"], "lora", "classification")
    assert finetune_cmd.main([*classify, "--training.fused_loss", "true", "--dry-run"]) == 2
    assert "set training.fused_loss false with --task classification" in \
        capsys.readouterr().err
    missing = ft_argv(tmp_path / "run", tmp_path / "nowhere", bases["sft"], "lora", "sft")
    assert finetune_cmd.main([*missing, "--dry-run"]) == 2
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: DDP, trainable gradients reduced
    assert finetune_cmd.main([*argv, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert 0 < plan["comm_bytes_per_step"]["all_reduce"] <= 2 * plan["finetune"]["trainable"] * 4
    assert finetune_cmd.main([*argv, "--parallel.tp", "2", "--dry-run", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)  # tensor parallel: the weights split over 2
    assert tp["layout"]["tp"] == 2 and tp["params_per_rank"] < 0.6 * plan["params_per_rank"]
    assert finetune_cmd.main([*argv, "--parallel.cp", "2", "--dry-run"]) == 2
    assert "pipeline, context and expert parallel fine-tuning" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_fp8_full_and_freeze_fine_tuning(bases: dict[str, Path], tmp_path: Path) -> None:
    """precision.fp8 in fine-tuning: every block linear (frozen ones too) is a float8 linear,
    training follows the run without fp8 closely but not bit-equal (fp8 really ran), and the
    output loads as a plain model."""
    from torchao.float8.float8_linear import Float8Linear

    from scaletrain.inference.loader import load_model

    def run(name: str, method: str, *extra: str) -> tuple[FinetuneTrainer, list[float]]:
        argv = ft_argv(tmp_path / name, bases["native"], bases["sft"], method, "sft",
                       "--training.steps", "3", *extra)
        trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
        return trainer, trainer.train().losses

    _, plain = run("plain", "full")
    fp8, losses = run("fp8", "full", "--precision.fp8", "tensorwise")
    wq = fp8.model.layers["0"].attention.wq
    assert isinstance(wq, Float8Linear) and wq.weight.requires_grad
    assert not isinstance(fp8.model.output, Float8Linear)  # the head stays as it is
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] != plain[0] and losses[0] == pytest.approx(plain[0], rel=2e-2)
    frozen, _ = run("freeze", "freeze", "--finetune.freeze_first", "1", "--precision.fp8",
                    "rowwise")
    first = frozen.model.layers["0"].feed_forward.w1
    assert isinstance(first, Float8Linear) and not first.weight.requires_grad
    loaded = load_model(tmp_path / "fp8")
    assert type(loaded.model.layers["0"].attention.wq) is torch.nn.Linear
    assert torch.equal(loaded.model.layers["0"].attention.wq.weight,
                       wq.weight.detach().cpu())


def test_a_dataset_smaller_than_one_batch_trains_with_a_logged_smaller_batch(
        bases: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    small = write_jsonl(tmp_path / "small.jsonl", qa_records(96)[:4])  # 3 train + 1 held out
    with caplog.at_level("INFO", logger="scaletrain.finetune"):
        trainer = run_ft(tmp_path / "small", bases["native"], small, "lora", "sft",
                         "--training.steps", "2")
    rows = int(re.search(r"data: (\d+) training", caplog.text).group(1))  # packed rows
    assert 1 <= trainer.mbs == rows < 8 and trainer.cfg.training.micro_batch_size == rows
    assert f"micro_batch_size lowered from 8 to {rows}" in caplog.text
    assert trainer.step == 2
