"""The training and validation sample orders of a run, from the `data` config section.

With `data.paths`, each indexed dataset is split by document (`data.split`) and the training
parts are blended by `data.weights`; without it, the built-in corpus (`corpus.py`) is
tokenized into two indexed datasets (train, val) on first use and read the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from scaletrain.config import ConfigError
from scaletrain.data.blend import BlendedDataset
from scaletrain.data.corpus import cache_root, prepare_corpus
from scaletrain.data.gpt_dataset import GPTDataset, split_ranges
from scaletrain.data.indexed import IndexedDataset, IndexedDatasetError, strip_prefix
from scaletrain.data.tokenize import sidecar_tokenizer
from scaletrain.data.tokenizer import TextTokenizer, TokenizerError, resolve_tokenizer_file

if TYPE_CHECKING:
    from scaletrain.config import Config
    from scaletrain.models.args import ModelArgs

log = logging.getLogger(__name__)


class DataSourceError(ConfigError):
    """`data.*` settings that cannot give a sample order; the message says what to change."""


@dataclass
class DataInfo:
    """What the trainer needs besides the batches."""

    tokenizer_path: Path
    vocab_size: int
    eos_id: int
    val: np.ndarray  # validation tokens, for a quick sample prompt
    fingerprint: str  # hash of everything that decides the sample order
    mixture: list[dict[str, Any]] = field(default_factory=list)


def parse_split(split: str) -> tuple[float, ...]:
    try:
        parts = tuple(float(x) for x in split.replace("/", ",").split(","))
    except ValueError:
        parts = ()
    if len(parts) not in (2, 3) or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataSourceError(f"data.split: '{split}' is not like '98,2,0' (train,val[,test] "
                              "shares of each dataset's documents)")
    return parts


def _tokenizer(cfg: Any, prefixes: list[Path]) -> TextTokenizer:
    spec = cfg.tokenizer or sidecar_tokenizer(prefixes[0])
    if spec is None:
        raise DataSourceError(f"no tokenizer for {prefixes[0]}: set data.tokenizer (the "
                              f"tokenizer.json it was made with; `scaletrain data tokenize` "
                              f"saves one as {prefixes[0]}.tokenizer.json)")
    try:
        tok = TextTokenizer.load(spec)
    except TokenizerError as e:
        raise DataSourceError(str(e)) from None
    for prefix in prefixes:  # token ids only mean something under the tokenizer that made them
        made_with = sidecar_tokenizer(prefix)
        if made_with is not None and not _same_tokenizer(made_with, tok):
            raise DataSourceError(
                f"data.paths: '{prefix}' was tokenized with a different tokenizer "
                f"({made_with}) than the one training uses ({tok.path}); tokenize every "
                "dataset of a run with one tokenizer (`scaletrain data tokenize --tokenizer "
                "FILE`)")
    return tok


def _same_tokenizer(path: Path, tok: TextTokenizer) -> bool:
    """Whether the tokenizer file `path` is `tok` (same bytes, or the same tokenizer
    written differently)."""
    if tok.path is not None and path.read_bytes() == tok.path.read_bytes():
        return True
    try:
        return Tokenizer.from_file(str(path)).to_str() == tok.tokenizer.to_str()
    except Exception:  # the Rust side raises a bare Exception on a bad file
        return False


def expected_vocab_size(cfg: Any) -> int | None:
    """The vocabulary size of the tokenizer a run with the `data` section `cfg` will use, found
    without tokenizing anything: `data.tokenizer`'s, else that of the tokenizer saved beside the
    first of `data.paths`, else `data.vocab_size` (the size of the tokenizer the run trains,
    which is at most that). None when the tokenizer cannot be read here (building the data
    then says why)."""
    spec: str | Path | None = cfg.tokenizer
    if spec is None and cfg.paths:
        spec = sidecar_tokenizer(strip_prefix(cfg.paths[0]))
    if spec is None:
        return None if cfg.paths else cfg.vocab_size
    try:
        return Tokenizer.from_file(str(resolve_tokenizer_file(spec))).get_vocab_size(
            with_added_tokens=True)
    except Exception:  # a missing file, bad JSON (the Rust side raises a bare Exception)
        return None


def resolve_model_args(cfg: Config) -> ModelArgs:
    """The model a training run builds: the preset with the `model.*` overrides; without
    `model.vocab_size`, a tokenizer larger than the preset's vocabulary widens it to the
    tokenizer's (a smaller one leaves the preset as it is, so the model matches
    `scaletrain plan --model PRESET`)."""
    args = cfg.model.to_model_args()
    if cfg.model.vocab_size is None:
        vocab = expected_vocab_size(cfg.data)
        if vocab is not None and vocab > args.vocab_size:
            log.info("model vocabulary: %d, the tokenizer's (larger than the preset's %d; set "
                     "--model.vocab_size to override)", vocab, args.vocab_size)
            args = args.replace(vocab_size=vocab)
    return args


def _open_dataset(prefix: Path) -> IndexedDataset:
    """An indexed dataset of `data.paths`, or an error naming the path and the fix."""
    if not Path(f"{prefix}.bin").is_file() or not Path(f"{prefix}.idx").is_file():
        raise DataSourceError(
            f"data.paths: '{prefix}' is not an indexed dataset ({prefix}.bin/.idx not found); "
            "give the PREFIX written by `scaletrain data tokenize --output PREFIX`"
        )
    try:
        ds = IndexedDataset(prefix)
    except IndexedDatasetError as e:
        raise DataSourceError(f"data.paths: {e}") from None
    if ds.num_documents == 0:
        raise DataSourceError(
            f"data.paths: '{prefix}' holds 0 documents; tokenize input that has some (if it "
            "came from `scaletrain data curate`, its stats.json says what was dropped)"
        )
    return ds


def _blend(parts: list[GPTDataset], weights: list[float], by: str, n: int | None,
           cache: Path) -> BlendedDataset:
    if n is None:
        n = sum(p.samples_per_epoch for p in parts)
    return BlendedDataset(parts, weights, n, by=by, cache_dir=cache)  # type: ignore[arg-type]


def build_sources(cfg: Any, seed: int, num_samples: int | None = None
                  ) -> tuple[BlendedDataset, BlendedDataset, DataInfo]:
    """(training order, validation order, info) for the `data` config section `cfg`."""
    cache = cache_root(cfg) / "index"
    if cfg.paths:
        prefixes = [strip_prefix(p) for p in cfg.paths]
        weights = list(cfg.weights) if cfg.weights else [1.0] * len(prefixes)
        split = parse_split(cfg.split)
        datasets = [_open_dataset(p) for p in prefixes]  # the paths first, then the tokenizer
        tok = _tokenizer(cfg, prefixes)
        train_parts, val_parts, val_w = [], [], []
        for prefix, w, ds in zip(prefixes, weights, datasets):
            ranges = split_ranges(ds.num_documents, split)
            try:
                train_parts.append(GPTDataset(ds, cfg.seq_len, seed, None, ranges[0],
                                              cache_dir=cache, name=str(prefix)))
                if ranges[1][1] > ranges[1][0]:
                    val_parts.append(GPTDataset(ds, cfg.seq_len, seed, None, ranges[1],
                                                shuffle=False, cache_dir=cache,
                                                name=str(prefix)))
                    val_w.append(w)
            except ValueError as e:  # too few tokens for one sample in a split
                raise DataSourceError(f"data.paths: {e} (data.split '{cfg.split}')") from None
        if not val_parts:
            counts = ", ".join(str(d.num_documents) for d in datasets)
            need = next((v for v in range(1, 50) if all(  # the smallest share that works
                (r := split_ranges(d.num_documents, (100 - v, v))[1])[1] > r[0]
                for d in datasets)), 50)
            raise DataSourceError(
                f"data.split '{cfg.split}' leaves no validation documents (the validation "
                f"share of {counts} document(s) rounds to 0); give the second share more "
                f"weight, e.g. --data.split {100 - need},{need},0")
        tok_path, vocab, eos = tok.path, tok.vocab_size, tok.eos_id
        first = val_parts[0]
        start = int(first.indexed.sequence_pointers[first.seq_range[0]])
        val_tokens = first.indexed.tokens[start // first.indexed.dtype.itemsize:]
        spec: dict[str, Any] = {"paths": [str(p.resolve()) for p in prefixes],
                                "weights": weights, "split": split}
    else:
        corpus = prepare_corpus(cfg)
        train_parts = [GPTDataset(IndexedDataset(corpus.train_prefix), cfg.seq_len, seed,
                                  cache_dir=cache, name=f"{cfg.dataset}:train")]
        try:
            val_parts = [GPTDataset(IndexedDataset(corpus.val_prefix), cfg.seq_len, seed,
                                    shuffle=False, cache_dir=cache, name=f"{cfg.dataset}:val")]
        except ValueError:
            raise ValueError(
                f"the validation split has {len(corpus.val)} tokens, less than one sequence "
                f"of {cfg.seq_len + 1}: raise data.val_fraction or data.max_bytes, or lower "
                "data.seq_len") from None
        weights, val_w = [1.0], [1.0]
        tok_path, vocab, eos = corpus.tokenizer_path, corpus.vocab_size, corpus.eos_id
        val_tokens = corpus.val
        spec = {"corpus": str(corpus.train_prefix.parent.name)}
    spec.update(seq_len=cfg.seq_len, seed=seed, by=cfg.blend_by)
    fingerprint = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    train = _blend(train_parts, weights, cfg.blend_by, num_samples, cache)
    val = _blend(val_parts, val_w, cfg.blend_by, None, cache)
    mixture = train.mixture()
    if len(mixture) > 1:
        for m in mixture:
            log.info("blend: %s target %.3f realized %.3f (%d samples, %.2f epochs)",
                     m["name"], m["target"], m["realized"], m["samples"], m["epochs"])
    info = DataInfo(tok_path, vocab, eos, val_tokens, fingerprint, mixture)
    return train, val, info
