"""MoE presets: `scaletrain models` shows total and active parameters and experts, equal to the
counts of transformers' model for the exported config and to the table in docs/models.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main as cli_main
from scaletrain.models.args import PRESETS, count_active_params, count_params

MOE = [name for name, a in PRESETS.items() if a.is_moe]
DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_cli_shows_total_active_and_experts(capsys):
    assert cli_main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert cli_main(["models"]) == 0
    table = capsys.readouterr().out
    for name in MOE:
        a = PRESETS[name]
        row = rows[name]
        assert row["params"] == count_params(a).total
        assert row["active_params"] == count_active_params(a) < row["params"]
        line = next(line for line in table.splitlines() if f" {name} " in line)
        assert f"{row['params']:,}" in line and f"{row['active_params']:,}" in line
        assert f" {a.n_experts_per_token}/{a.n_experts} " in line
    dense = next(line for line in table.splitlines() if " llama3-8b " in line)
    assert dense.count("8,030,261,248") == 2  # dense: active = total


def test_docs_table_matches_the_presets():
    section = DOC.read_text().split("## Mixture-of-Experts families")[1].split("\n## ")[0]
    documented = {m.group(1): (m.group(2), m.group(3), m.group(4))
                  for m in re.finditer(r"\| `([\w.-]+)` \| ([\d,]+) \| ([\d,]+) \| (\d+/\d+) \|",
                                       section)}
    assert set(documented) == set(MOE)
    for name, (total, active, experts) in documented.items():
        a = PRESETS[name]
        assert total == f"{count_params(a).total:,}", name
        assert active == f"{count_active_params(a):,}", name
        assert experts == f"{a.n_experts_per_token}/{a.n_experts}", name


@pytest.mark.parametrize("name", ["mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b",
                                  "qwen3-235b-a22b"])
def test_counts_equal_transformers_model_and_published_sizes(name):
    transformers = pytest.importorskip("transformers")
    from scaletrain.models.hf import hf_config_from_model_args

    args = PRESETS[name]
    cfg = transformers.AutoConfig.for_model(**hf_config_from_model_args(args))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(args).total
    published = {"mixtral-8x7b": (46.7e9, 12.9e9), "mixtral-8x22b": (141e9, 39e9),
                 "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9)}[name]
    total, active = count_params(args).total, count_active_params(args)
    assert abs(total - published[0]) / published[0] < 0.005
    assert abs(active - published[1]) / published[1] < 0.03
