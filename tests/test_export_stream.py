"""`scaletrain convert SRC DST --to hf` writes block by block (`finetune.export`): the shards
are transformers' (`model-0000K-of-0000N.safetensors` + index, each within --max-shard-size),
transformers loads them, they hold the model the one loader builds, and the export's peak
host memory (measured in a fresh process) stays well below the model's size: one shard and
one block at a time, never the whole model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.commands import convert as convert_cmd

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent

_MEASURE = """
import json, sys
from scaletrain.checkpoint.sharded_load import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from scaletrain.commands import convert
import scaletrain.finetune.export, safetensors.torch  # imported before the measurement
reset_peak_rss()
before = current_rss_bytes()
assert convert.main(sys.argv[1:]) == 0
print(json.dumps({"rise": peak_rss_bytes() - before}))
"""


def test_export_streams_hf_shards_within_a_fraction_of_the_model(tmp_path: Path) -> None:
    from bench.finetune_load_cpu import base_sizes, make_base

    dims = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                max_position_embeddings=256, tie_word_embeddings=False)
    src = make_base(tmp_path / "src", dims, "2GB", torch.float32)
    sizes = base_sizes(src, torch.float32)
    shard = 16 * 2**20
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(src), str(tmp_path / "dst"), "--to", "hf",
         "--max-shard-size", str(shard)],
        capture_output=True, text=True, cwd=ROOT, check=True)
    rise = json.loads(out.stdout.strip().splitlines()[-1])["rise"]
    # block 0 carries the embeddings and the head: the largest group
    group = 2 * 8192 * 512 * 4 + sizes["base_bytes"] // 20
    bound = 2 * shard + 2 * group + 16 * 2**20  # the shard's bytes copy; a group in the making
    assert bound < 0.7 * sizes["base_bytes"]
    print(f"export peak RSS rise {rise / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, model "
          f"{sizes['base_bytes'] / 2**20:.0f} MiB")
    assert rise <= bound, (rise / 2**20, bound / 2**20, sizes["base_bytes"] / 2**20)
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 5 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:
        assert (tmp_path / "dst" / f).stat().st_size <= shard + 2**20
    want = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "dst",
                                                        dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_lora_export_is_the_merged_model(tmp_path: Path) -> None:
    """A LoRA fine-tune (norms trained too) exported with shards equals the merged model the
    loader builds, tensor for tensor."""
    from scaletrain.config import load_config
    from scaletrain.finetune.loading import load_finetuned
    from scaletrain.finetune.trainer import FinetuneTrainer
    from scaletrain.models.hf import to_hf_state_dict
    from scaletrain.train.trainer import Trainer
    from tests.finetune_helpers import qa_records, write_jsonl
    from tests.trainer_helpers import tiny_config

    Trainer(tiny_config(tmp_path / "pre", tmp_path / "cache", "--training.steps", "2")).train()
    data = write_jsonl(tmp_path / "sft.jsonl", qa_records(32))
    out = tmp_path / "ft"
    FinetuneTrainer(load_config([
        "--config", "finetune", "--output", str(out), "--finetune.base", str(tmp_path / "pre"),
        "--finetune.data", str(data), "--finetune.method", "lora", "--finetune.task", "sft",
        "--finetune.lora_rank", "4", "--finetune.train_norms", "true", "--data.seq_len", "64",
        "--training.micro_batch_size", "8", "--training.steps", "3",
        "--training.eval_interval", "0", "--optimizer.lr", "1e-2",
        "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"],
        prog="scaletrain finetune")).train()
    assert convert_cmd.main([str(out), str(tmp_path / "hf"), "--to", "hf",
                             "--max-shard-size", "200KB"]) == 0
    merged = load_finetuned(out).model
    want = to_hf_state_dict(merged.state_dict(), merged.args)
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                            dtype=torch.float32).state_dict()
    assert len(set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
                   ["weight_map"].values())) > 1
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
