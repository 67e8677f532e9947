"""`scaletrain convert` and `scaletrain generate` end to end, plus the native checkpoint format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from scaletrain.checkpoint.native_format import (  # noqa: E402
    load_model_checkpoint,
    read_meta,
    save_model_checkpoint,
)
from scaletrain.commands import convert, generate  # noqa: E402
from scaletrain.inference.generation import generate as generate_ids  # noqa: E402
from scaletrain.inference.loader import load_for_inference  # noqa: E402
from scaletrain.models.args import ModelArgs  # noqa: E402
from scaletrain.models.hf import load_hf_checkpoint  # noqa: E402
from scaletrain.models.transformer import build_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEXT = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot today",
        "we like to read books", "rain falls on the green hills"] * 4


def _tokenizer(path: Path) -> Path:
    """A tiny word-piece BPE (< 128 ids) with an end-of-text token, trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator(TEXT, trainer)
    assert tok.get_vocab_size() <= 128
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A transformers-written Llama checkpoint with a tokenizer.json beside it."""
    path = tmp_path_factory.mktemp("cli") / "hf"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.15, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    _tokenizer(path / "tokenizer.json")
    return path


def _logits(model, seq: int = 40) -> torch.Tensor:
    x = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(x)


def test_convert_round_trip_hf_native_hf(hf_dir, tmp_path, capsys):
    native, back = tmp_path / "native", tmp_path / "back"
    assert convert.main([str(hf_dir), str(native), "--to", "native"]) == 0
    assert convert.main([str(native), str(back), "--to", "hf", "--max-shard-size", "30KB"]) == 0
    assert "wrote hf checkpoint" in capsys.readouterr().out
    meta = read_meta(native)
    assert meta["format"] == "scaletrain-native" and meta["tokenizer"] == "tokenizer.json"
    assert (native / "tokenizer.json").is_file() and (back / "tokenizer.json").is_file()
    assert (back / "model.safetensors.index.json").is_file()
    orig, _ = load_hf_checkpoint(hf_dir)
    mid, _, tok = load_model_checkpoint(native)
    again, args = load_hf_checkpoint(back)
    assert tok == native / "tokenizer.json" and args.tie_embeddings
    assert torch.equal(_logits(orig), _logits(mid))
    assert torch.equal(_logits(orig), _logits(again))
    hf = transformers.LlamaForCausalLM.from_pretrained(back).eval()
    x = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf(x).logits - _logits(again)).abs().max().item()
    assert diff <= 1e-5
    # eos carried through the tokenizer's <|endoftext|> token into the exported config
    eos = json.loads((back / "config.json").read_text())["eos_token_id"]
    assert eos == 1  # <|endoftext|> is the second special token


def test_generate_json_with_prompt_ids(hf_dir, capsys):
    argv = ["--checkpoint", str(hf_dir), "--prompt-ids", "5,17,99,3", "--max-new-tokens", "12",
            "--temperature", "0", "--no-eos", "--json"]
    assert generate.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    model, _, tokenizer, eos = load_for_inference(hf_dir)
    assert eos == 1 and tokenizer is not None
    assert out["ids"] == generate_ids(model, [5, 17, 99, 3], 12)
    assert out["text"] == tokenizer.decode(out["ids"], skip_special_tokens=True)


def test_generate_text_prompt_and_seeded_sampling(hf_dir, capsys):
    argv = ["--checkpoint", str(hf_dir), "--prompt", "the cat sat", "--max-new-tokens", "8",
            "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9", "--seed", "7", "--json"]
    assert generate.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert generate.main(argv) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert 1 <= len(first["ids"]) <= 8 and isinstance(first["text"], str)


def test_generate_from_run_dir_and_without_tokenizer(tmp_path, capsys):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=64)
    run = tmp_path / "run" / "checkpoints"
    for step, seed in ((100, 1), (2000, 2)):
        save_model_checkpoint(build_model(args, seed=seed), args, run / f"step-{step:07d}",
                              step=step)
    (run / "step-0009999").mkdir()  # incomplete (no meta.json): must be skipped
    model, _, tokenizer, eos = load_for_inference(tmp_path / "run")
    assert tokenizer is None and eos is None
    assert torch.equal(_logits(model), _logits(build_model(args, seed=2)))

    argv = ["--checkpoint", str(tmp_path / "run"), "--prompt-ids", "1,2,3", "--temperature", "0",
            "--max-new-tokens", "5"]
    assert generate.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] is None and len(out["ids"]) == 5
    assert generate.main(argv) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, out["ids"]))

    assert generate.main(["--checkpoint", str(tmp_path / "run"), "--prompt", "hi"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--checkpoint", "/nonexistent/ckpt", "--prompt-ids", "1"], "does not exist"),
    (["--checkpoint", ".", "--prompt-ids", "a,b"], "comma-separated integers"),
    (["--checkpoint", "."], "one of the arguments"),
    (["--checkpoint", ".", "--prompt-ids", "1", "--device", "nonsense"], "nonsense"),
])
def test_generate_bad_input_returns_2(argv, message, capsys):
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_convert_bad_input_returns_2(hf_dir, tmp_path, capsys):
    assert convert.main([str(tmp_path), str(tmp_path / "x"), "--to", "hf"]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    assert convert.main([str(hf_dir), str(hf_dir), "--to", "native"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert convert.main([str(hf_dir), str(tmp_path / "y"), "--to", "onnx"]) == 2
    assert not (tmp_path / "y").exists()


def test_generate_as_module(hf_dir):
    cmd = [sys.executable, "-m", "scaletrain.commands.generate", "--checkpoint", str(hf_dir),
           "--prompt-ids", "4,5,6", "--max-new-tokens", "3", "--temperature", "0", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["ids"]) <= 3


# --- native format -------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_native_loads_model_key_next_to_optimizer_state(tmp_path):
    """The trainer's checkpoints hold more than the model; loading must read only "model"."""
    import torch.distributed.checkpoint as dcp

    from scaletrain.checkpoint.integrity import write_manifest
    from scaletrain.checkpoint.native_format import write_meta

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, tie_embeddings=True)
    model = build_model(args, seed=5)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {"n": 3}},
             checkpoint_id=tmp_path / "ck", no_dist=True)
    write_meta(tmp_path / "ck", 7, args, None)
    write_manifest(tmp_path / "ck")
    loaded, loaded_args, tok = load_model_checkpoint(tmp_path / "ck")
    assert loaded_args == args and tok is None
    assert loaded.output.weight is loaded.tok_embeddings.weight
    assert torch.equal(_logits(loaded), _logits(model))


def test_native_errors_name_the_problem(tmp_path):
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128)
    with pytest.raises(ValueError, match="manifest.json not found"):
        load_model_checkpoint(tmp_path)
    save_model_checkpoint(build_model(args, seed=0), args, tmp_path / "ck", step=3)
    assert read_meta(tmp_path / "ck")["step"] == 3
    meta = tmp_path / "ck" / "meta.json"
    good = meta.read_text()
    meta.write_text(good[:20])
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        read_meta(tmp_path / "ck")
    bigger = json.loads(good)
    bigger["model_args"]["n_layers"] = 2
    meta.write_text(json.dumps(bigger))
    with pytest.raises(ValueError, match=r"meta.json has \d+ bytes but manifest.json records"):
        load_model_checkpoint(tmp_path / "ck")
    from scaletrain.checkpoint.integrity import verification

    with verification(False), pytest.raises(
            ValueError, match=r"meta.json: model_args.n_layers is 2 but .metadata holds 1 layer"):
        load_model_checkpoint(tmp_path / "ck")
    with pytest.raises(FileExistsError):
        save_model_checkpoint(build_model(args), args, tmp_path / "ck")


def test_generate_defaults_come_from_generation_config(hf_dir, tmp_path, capsys):
    import shutil

    greedy_dir = tmp_path / "greedy"
    shutil.copytree(hf_dir, greedy_dir)
    (greedy_dir / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    argv = ["--prompt-ids", "5,17,99,3", "--max-new-tokens", "12", "--no-eos", "--json"]
    assert generate.main(["--checkpoint", str(greedy_dir), *argv]) == 0
    model = load_for_inference(greedy_dir)[0]
    assert json.loads(capsys.readouterr().out)["ids"] == generate_ids(model, [5, 17, 99, 3], 12)
    (greedy_dir / "generation_config.json").write_text(json.dumps({"temperature": 1.5}))
    outs = set()
    for seed in range(3):
        assert generate.main(["--checkpoint", str(greedy_dir), *argv, "--seed", str(seed)]) == 0
        outs.add(tuple(json.loads(capsys.readouterr().out)["ids"]))
    assert len(outs) > 1  # sampled, not greedy
