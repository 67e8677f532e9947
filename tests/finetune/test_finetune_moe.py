"""LoRA fine-tuning of Mixture-of-Experts models (attention and experts): the loss falls, PEFT
loads the adapter on transformers' Mixtral / Qwen3-MoE with our logits, adapters PEFT trains
load into ours, merging folds the expert updates in; QLoRA keeps the experts dense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from scaletrain.commands import convert as convert_cmd  # noqa: E402
from scaletrain.config import load_config  # noqa: E402
from scaletrain.finetune.loading import load_finetuned  # noqa: E402
from scaletrain.finetune.lora import LoRAError, LoRASettings, apply_lora  # noqa: E402
from scaletrain.finetune.lora_experts import LoRAExperts, expert_adapters  # noqa: E402
from scaletrain.finetune.peft_io import load_adapter  # noqa: E402
from scaletrain.finetune.trainer import FinetuneTrainer  # noqa: E402
from scaletrain.models.hf import load_hf_checkpoint  # noqa: E402
from scaletrain.plan.finetune.estimate import estimate  # noqa: E402
from tests.helpers.family import tokens  # noqa: E402
from tests.helpers.finetune import qa_records, word_tokenizer, write_jsonl  # noqa: E402
from tests.helpers.moe_hf import hf_moe_model  # noqa: E402

QUIET = ["--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
         "--metrics.log_interval", "1", "--precision.dtype", "fp32"]
ALL = "q,k,v,o,gate,up,down"


@pytest.fixture(scope="module")
def moe_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_ft")
    out = {"sft": write_jsonl(root / "sft.jsonl", qa_records(64))}
    for name in ("mixtral", "qwen3_moe"):
        hf_moe_model(name).save_pretrained(root / name)
        word_tokenizer(root / name / "tokenizer.json")
        out[name] = root / name
    return out


def _run(output: Path, base: Path, data: Path, method: str, *extra: str) -> FinetuneTrainer:
    argv = ["--config", "finetune", "--output", str(output), "--finetune.base", str(base),
            "--finetune.data", str(data), "--finetune.method", method, "--finetune.task", "sft",
            "--data.seq_len", "32", "--training.micro_batch_size", "4",
            "--training.grad_accum_steps", "2", "--training.eval_interval", "0",
            "--lr_schedule.warmup_steps", "1", "--finetune.lora_rank", "4",
            "--finetune.lora_dropout", "0", "--optimizer.lr", "1e-2", *QUIET, *extra]
    trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
    trainer.train()
    return trainer


def _losses(output: Path) -> list[float]:
    rows = [json.loads(x) for x in (output / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_lora_on_attention_and_experts_trains_and_loads_in_peft(moe_bases, tmp_path, name):
    out = tmp_path / "ft"
    trainer = _run(out, moe_bases[name], moe_bases["sft"], "lora", "--training.steps", "8",
                   "--finetune.lora_targets", ALL)
    losses = _losses(out)
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses
    # Only the adapters train: attention LoRA and per-expert factors; the experts stay frozen.
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("experts.gate_up_A" in n for n in trainable)
    assert any("experts.down_B" in n for n in trainable)
    assert not any(n.endswith(("experts.base.w1", "router.gate.weight")) for n in trainable)
    assert sum(p.numel() for n, p in trainer.model.named_parameters() if p.requires_grad) == \
        estimate(trainer.base.args, "lora", rank=4).trainable
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert "gate_proj" not in config["target_modules"]

    ours = load_finetuned(out, merge=False).model.eval()
    x = tokens(24)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        moe_bases[name], dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = ours(x)
        base = hf(x).logits
    assert (expected - base).abs().max() > 1e-2  # training moved the model
    peft_model = peft.PeftModel.from_pretrained(hf, out / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, expected, atol=1e-5, rtol=1e-5)
    # `convert OUTPUT MERGED --to hf`: adapters folded into the attention and expert weights
    # (W + s B A rounded once: 1e-4, as for dense models).
    assert convert_cmd.main([str(out), str(tmp_path / "merged"), "--to", "hf"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, expected, atol=1e-4, rtol=1e-4)


def test_adapter_trained_by_peft_loads_into_ours(moe_bases, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        moe_bases["qwen3_moe"], dtype=torch.float32, attn_implementation="eager")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"],
                             init_lora_weights=False)
    peft_model = peft.get_peft_model(hf, config).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    ours, _ = load_hf_checkpoint(moe_bases["qwen3_moe"])
    settings = load_adapter(tmp_path / "peft", ours)
    assert set(settings.targets) == {"q", "o", "gate", "up", "down"}
    x = tokens(24)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), peft_model(x).logits, atol=1e-5, rtol=1e-5)


def test_grouped_and_loop_expert_lora_agree_and_bad_targets_are_refused(moe_bases):
    outs = []
    for compute in ("grouped", "loop"):
        model, args = load_hf_checkpoint(moe_bases["mixtral"])
        for _, block in model.layers.items():
            block.feed_forward.experts.compute = compute
        torch.manual_seed(0)
        # rank 3: the grouped path pads it to 16-byte strides, the loop does not
        apply_lora(model, LoRASettings(rank=3, alpha=8.0, targets=("gate", "up", "down")))
        with torch.no_grad():
            for lora in expert_adapters(model).values():
                lora.gate_up_B.normal_(std=0.2)
                lora.down_B.normal_(std=0.2)
        x = tokens(16)
        loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outs.append((loss.detach(), grads))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    assert outs[0][1].keys() == outs[1][1].keys() and len(outs[0][1]) == 4 * len(model.layers)
    for n, g in outs[0][1].items():
        torch.testing.assert_close(g, outs[1][1][n], atol=1e-5, rtol=1e-5, msg=n)
    model, _ = load_hf_checkpoint(moe_bases["mixtral"])
    with pytest.raises(LoRAError, match="gate and up"):
        apply_lora(model, LoRASettings(rank=4, targets=("q", "gate")))
    model, _ = load_hf_checkpoint(moe_bases["mixtral"])
    with pytest.raises(LoRAError, match="lora_dropout 0"):
        apply_lora(model, LoRASettings(rank=4, dropout=0.1, targets=("down",)))
    model, _ = load_hf_checkpoint(moe_bases["mixtral"])
    apply_lora(model, LoRASettings(rank=4, dropout=0.1, targets=("q", "v")))  # attention only
    assert not expert_adapters(model)


def test_qlora_quantizes_attention_and_keeps_router_and_experts_dense(moe_bases, tmp_path):
    """In bf16 autocast, rank 4: the expert factors' grouped GEMMs need the padded rank."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "q"
    trainer = _run(out, moe_bases["mixtral"], moe_bases["sft"], "qlora", "--training.steps",
                   "6", "--finetune.lora_targets", ALL, "--precision.dtype", "bf16")
    losses = _losses(out)
    assert losses[-1] < 0.9 * losses[0], losses
    block = trainer.model.layers["0"]
    assert type(block.attention.wq.base).__name__ == "Linear4bit"
    assert type(block.feed_forward.router.gate) is torch.nn.Linear
    assert isinstance(block.feed_forward.experts, LoRAExperts)
