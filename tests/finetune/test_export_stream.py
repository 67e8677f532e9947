"""`scaletrain convert SRC DST --to hf` writes block by block (`finetune.export`): the shards
are transformers' (`model-0000K-of-0000N.safetensors` + index, each within --max-shard-size),
transformers loads them and they hold the source's tensors, and the export's peak host memory
(measured in a fresh process) stays well below the model's size: one shard and one block at a
time, never the whole model. (A LoRA fine-tune's merged export against PEFT's merge:
tests/finetune/test_finetune_train.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]

_MEASURE = """
import json, sys
from scaletrain.host import current_rss_bytes, peak_rss_bytes, reset_peak_rss
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
    want: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        want.update(load_file(f))
    got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "dst",
                                                        dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
