"""`scaletrain convert --to hf` of a run whose tokenizer scaletrain trained writes a tokenizer
folder that transformers' `AutoTokenizer` and lm-evaluation-harness's own `hf` model (HFLM) load
(issue 35: there was no `tokenizer_config.json`, so lm_eval could not use the export); HFLM on
the export scores like `scaletrain eval` on the native checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.checkpoint.native_format import save_model_checkpoint  # noqa: E402
from scaletrain.commands import convert  # noqa: E402
from scaletrain.data.tokenizer import EOS_TOKEN, train_bpe  # noqa: E402
from scaletrain.models.args import ModelArgs  # noqa: E402
from scaletrain.models.transformer import build_model  # noqa: E402
from tests.helpers.synth import TEXT  # noqa: E402

SAMPLE = "The cat sat on the mat.\n  def main():  return 1 -- ünïcode"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(native checkpoint with a byte-level BPE trained as `scaletrain train` trains it, its
    `convert --to hf` export)."""
    root = tmp_path_factory.mktemp("convert-tok")
    tok = train_bpe(TEXT * 3, vocab_size=300)
    tok.save(str(root / "tokenizer.json"))
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=96)
    model = build_model(args, seed=0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(4)
    save_model_checkpoint(model, args, root / "native", tokenizer_file=root / "tokenizer.json")
    assert convert.main([str(root / "native"), str(root / "hf"), "--to", "hf"]) == 0
    return root / "native", root / "hf"


def test_the_export_is_a_tokenizer_folder_transformers_loads(exported: tuple[Path, Path]) -> None:
    from tokenizers import Tokenizer

    native, hf = exported
    config = json.loads((hf / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS_TOKEN and config["model_max_length"] == 96
    assert json.loads((hf / "special_tokens_map.json").read_text()) == {"eos_token": EOS_TOKEN}
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ours = Tokenizer.from_file(str(native / "tokenizer.json"))
    assert tok.eos_token == EOS_TOKEN
    assert tok.eos_token_id == ours.token_to_id(EOS_TOKEN)
    assert tok.eos_token_id == json.loads((hf / "config.json").read_text())["eos_token_id"]
    assert tok(SAMPLE)["input_ids"] == ours.encode(SAMPLE).ids
    assert tok.decode(tok(SAMPLE)["input_ids"]) == SAMPLE


def test_lm_eval_hf_model_on_the_export_scores_as_scaletrain_eval(
        exported: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from scaletrain.evaluation.harness import ScaletrainLM
    from tests.evaluation.test_eval import write_tasks

    native, hf = exported
    tasks = write_tasks(tmp_path / "tasks")
    names = ["tiny_ll", "tiny_rolling", "tiny_gen"]

    def run(lm: object) -> dict:
        out = simple_evaluate(model=lm, tasks=names, bootstrap_iters=0, log_samples=True,
                              task_manager=TaskManager(include_path=str(tasks),
                                                       include_defaults=False))
        assert out is not None
        return out

    theirs = run(HFLM(pretrained=str(hf), device="cpu", batch_size=4, dtype="float32"))
    mine = run(ScaletrainLM(checkpoint=str(native), batch_size=4))
    for task in names:
        a = sorted(mine["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            assert str(x["filtered_resps"]) == str(y["filtered_resps"]) or all(
                u == pytest.approx(v, rel=1e-4, abs=1e-4)
                for u, v in zip(_numbers(x["filtered_resps"]), _numbers(y["filtered_resps"]),
                                strict=True)), (task, x["filtered_resps"], y["filtered_resps"])


def _numbers(x: object) -> list[float]:
    if isinstance(x, (list, tuple)):
        return [n for item in x for n in _numbers(item)]
    return [float(x)] if isinstance(x, (int, float)) else []
