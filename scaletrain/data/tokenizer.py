"""Tokenizers: load a `tokenizer.json` (or a Hugging Face tokenizer directory), or train a
byte-level BPE on any texts; find the end-of-document (and optional begin-of-document) token.

Everything here is a thin layer over Hugging Face `tokenizers` (the Rust library does the work).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens recognised in a given tokenizer, in this order.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names the file and the fix."""


def resolve_tokenizer_file(spec: str | Path, what: str = "data.tokenizer") -> Path:
    """A tokenizer.json path from a file or a Hugging Face tokenizer directory holding one."""
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(
            f"{what}: '{p}' not found; give a tokenizer.json file or a directory holding one "
            "(a Hugging Face tokenizer directory), or train one instead"
        )
    return p


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's rule), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def train_bpe(texts: Iterable[str], vocab_size: int, progress: bool = False,
              length: int | None = None, bos: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer with `<|endoftext|>` as its only special token (and
    `<|begin_of_text|>` after it with `bos`, for documents that start with one).

    No normalizer and no prefix space, so `decode(encode(x)) == x` for any text.
    """
    specials = [EOS_TOKEN, BOS_CANDIDATES[0]] if bos else [EOS_TOKEN]
    n_base = len(pre_tokenizers.ByteLevel.alphabet()) + len(specials)
    if vocab_size < n_base:
        raise TokenizerError(
            f"vocab_size must be at least {n_base} (256 bytes + {', '.join(specials)}); got "
            f"{vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def _find(tok: Tokenizer, names: tuple[str, ...]) -> int | None:
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    return None


def find_eos_id(tok: Tokenizer, source: Path | str) -> int:
    tid = _find(tok, EOS_CANDIDATES)
    if tid is None:
        raise TokenizerError(
            f"tokenizer '{source}' has none of the end-of-document tokens "
            f"{', '.join(EOS_CANDIDATES)}; add one as a special token"
        )
    return tid


@dataclass
class TextTokenizer:
    """A loaded tokenizer with its document separators: `encode` gives one document's ids
    (without special tokens added by the tokenizer's post-processor), then EOS, and BOS first
    when `add_bos`."""

    tokenizer: Tokenizer
    path: Path | None
    eos_id: int
    bos_id: int | None = None
    add_bos: bool = False

    @classmethod
    def load(cls, spec: str | Path, add_bos: bool = False) -> TextTokenizer:
        path = resolve_tokenizer_file(spec)
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise TokenizerError(f"tokenizer '{path}' cannot be read: {e}") from None
        return cls.wrap(tok, path, add_bos)

    @classmethod
    def wrap(cls, tok: Tokenizer, path: Path | None, add_bos: bool = False) -> TextTokenizer:
        bos = _find(tok, BOS_CANDIDATES)
        if add_bos and bos is None:
            raise TokenizerError(
                f"tokenizer '{path}' has no begin-of-document token ({', '.join(BOS_CANDIDATES)})"
                "; drop the BOS option or add one as a special token"
            )
        return cls(tok, path, find_eos_id(tok, path or "trained"), bos, add_bos)

    @property
    def vocab_size(self) -> int:
        """Every id is below this (special tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids per document with the separators, encoded in parallel by `tokenizers`."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encs = encode(texts, add_special_tokens=False)
        head = [self.bos_id] if self.add_bos else []
        dtype = self.dtype
        return [np.asarray(head + e.ids + [self.eos_id], dtype=dtype) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
