"""A tiny native checkpoint with a tokenizer, and scripted generators, for synth/serve tests."""

from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.inference.generators import Completion, SamplingParams

TEXT = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot today",
        "we like to read books", "rain falls on the green hills"] * 4


def tiny_checkpoint(directory: Path, arch: str = "llama") -> Path:
    """A random 2-layer model (vocab 128) saved natively, tokenizer.json copied in."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from scaletrain.checkpoint.native_format import save_model_checkpoint
    from scaletrain.models.args import ModelArgs
    from scaletrain.models.transformer import build_model

    directory.parent.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<unk>", "<|endoftext|>"]))
    tok_path = directory.parent / f"{directory.name}-tokenizer.json"
    tok.save(str(tok_path))
    args = ModelArgs(arch=arch, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                     max_seq_len=128)
    model = build_model(args, seed=0)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(5)
    save_model_checkpoint(model, args, directory, tokenizer_file=tok_path)
    return directory


class ScriptedGenerator:
    """Answers from a function of (prompt, seed); counts calls; can fail after some calls."""

    name = "scripted"

    def __init__(self, fn, fail_after_calls: int | None = None):
        self.fn, self.fail_after = fn, fail_after_calls
        self.calls: list[list[str]] = []
        self.tokens_generated = 0

    def complete(self, prompts, params: SamplingParams, seeds=None):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("simulated crash")
        self.calls.append(list(prompts))
        seeds = seeds or [None] * len(prompts)
        return [Completion(self.fn(p, s), 3, "stop") for p, s in zip(prompts, seeds)]


def lines(path: Path) -> list[str]:
    """The non-empty lines of a text file."""
    return [x for x in Path(path).read_text().splitlines() if x.strip()]
