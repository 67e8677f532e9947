"""Hugging Face Phi-3 (fused qkv / gate_up in its checkpoints) -> `scaletrain finetune` a few
steps -> `convert --to hf`: transformers loads the result with our logits; the LoRA run's
adapter loads in PEFT on transformers' base with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from scaletrain.commands import convert as convert_cmd  # noqa: E402
from scaletrain.config import load_config  # noqa: E402
from scaletrain.finetune.loading import load_finetuned  # noqa: E402
from scaletrain.finetune.trainer import FinetuneTrainer  # noqa: E402
from tests.helpers.family import hf_model, tokens  # noqa: E402
from tests.helpers.finetune import qa_records, word_tokenizer, write_jsonl  # noqa: E402


@pytest.mark.parametrize("method", ["full", "lora"])
def test_phi3_fine_tuned_and_exported_loads_in_transformers(tmp_path: Path, method: str):
    hf_model("phi3").save_pretrained(tmp_path / "base")
    word_tokenizer(tmp_path / "base" / "tokenizer.json")
    data = write_jsonl(tmp_path / "sft.jsonl", qa_records(16))
    out = tmp_path / "run"
    argv = ["--config", "finetune", "--output", str(out), "--finetune.base",
            str(tmp_path / "base"), "--finetune.data", str(data), "--finetune.method", method,
            "--finetune.task", "sft", "--data.seq_len", "32", "--training.micro_batch_size", "4",
            "--training.steps", "2", "--training.eval_interval", "0",
            "--lr_schedule.warmup_steps", "1", "--finetune.lora_rank", "4",
            "--finetune.lora_dropout", "0", "--optimizer.lr", "1e-2",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"]
    FinetuneTrainer(load_config(argv, prog="scaletrain finetune")).train()
    x = tokens(40)
    with torch.no_grad():
        ours = load_finetuned(out, merge=True).model(x)
        base = hf_model("phi3")(x).logits
    assert (ours - base).abs().max() > 1e-2  # training changed the model
    assert convert_cmd.main([str(out), str(tmp_path / "hf"), "--to", "hf"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, ours, atol=1e-5, rtol=1e-5)
        if method == "lora":
            with_adapter = peft.PeftModel.from_pretrained(hf_model("phi3"), out / "adapter")
            torch.testing.assert_close(with_adapter.eval()(x).logits, ours, atol=1e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_logs_name_the_family_not_the_block(tmp_path: Path, family: str, caplog) -> None:
    """Families built on the Llama block are logged by their own name."""
    from scaletrain.models.hf import load_hf_checkpoint

    hf_model(family).save_pretrained(tmp_path / "m")
    with caplog.at_level("INFO", logger="scaletrain"):
        load_hf_checkpoint(tmp_path / "m")
    assert f"loaded {family} checkpoint" in caplog.text
