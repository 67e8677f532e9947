"""A directory of text files -> a byte-level BPE tokenizer and two cached token streams.

`prepare_corpus(cfg)` finds the corpus files (the Python standard library's own sources by
default), trains a tokenizer (or loads `cfg.tokenizer`), tokenizes every document, holds out
whole documents for validation and writes `train.bin`, `val.bin`, `tokenizer.json` and
`meta.json` into a cache directory whose name is a hash of everything that determines their
content. A later call with the same inputs only maps the cached arrays (well under a second).

Cache entries are built in a temporary directory and renamed into place when complete, so an
interrupted build never leaves an entry that looks whole, and two processes building the same
entry at once both end up reading one complete copy.

This module is the small stand-in for the indexed-dataset pipeline of `scaletrain data`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scaletrain.config import DataConfig

log = logging.getLogger("scaletrain.data")

FORMAT_VERSION = 2
EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens recognised in a tokenizer given by `data.tokenizer`, in this order.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
# Directories never read from the standard library (installed packages are not the stdlib).
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# The test suites: 60% of the stdlib's ~31 MB, with deliberately odd fixtures (legacy
# encodings, invalid syntax); some distributions ship them as a separate package.
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SPLIT_SEED = 20240517  # fixed: the validation documents depend only on the corpus
_CHUNK_BYTES = 1 << 20  # text handed to one encode_batch call (progress granularity)
_STALE_TMP_SECONDS = 24 * 3600


class CorpusError(ValueError):
    """A corpus that cannot be built; the message names the input and the fix."""


@dataclass
class TokenizedCorpus:
    """The token streams of one cached corpus.

    `train` and `val` are read-only 1-D memory maps (uint16 when the vocabulary fits, else
    int32); every document is followed by `eos_id`. `vocab_size` is the size of the
    tokenizer's vocabulary, special tokens included: every id is below it.
    """

    train: np.ndarray
    val: np.ndarray
    tokenizer_path: Path
    vocab_size: int
    eos_id: int

    @property
    def cache_dir(self) -> Path:
        return self.tokenizer_path.parent

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.tokenizer_path))


@dataclass(frozen=True)
class SourceFile:
    """One corpus file and the number of its bytes that are read (`max_bytes` may cut it)."""

    path: Path
    rel: str
    size: int
    mtime_ns: int
    read_bytes: int


# --- file discovery ----------------------------------------------------------------------------
def corpus_root(cfg: DataConfig) -> Path:
    """The directory the corpus files are read from."""
    if cfg.dataset == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    if cfg.dataset != "text_dir":
        raise CorpusError(f"data.dataset: unknown dataset '{cfg.dataset}' (stdlib or text_dir)")
    if not cfg.path:
        raise CorpusError('data.path is required with data.dataset = "text_dir"')
    root = Path(cfg.path).expanduser()
    if not root.is_dir():
        raise CorpusError(f"data.path: '{root}' is not a directory; point it at your text files")
    return root


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Translate a glob over '/'-separated relative paths ('**/' = any number of dirs)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def discover_files(cfg: DataConfig) -> tuple[Path, list[SourceFile]]:
    """The corpus files matching `cfg.file_glob`, sorted by relative path, capped by max_bytes.

    Hidden directories are skipped; for the stdlib also site-/dist-packages, and the test
    suites unless `cfg.stdlib_tests`.
    """
    root = corpus_root(cfg)
    skip = frozenset({"__pycache__"})
    if cfg.dataset == "stdlib":
        skip = _STDLIB_SKIP_DIRS | (frozenset() if cfg.stdlib_tests else _STDLIB_TEST_DIRS)
    match = _glob_regex(cfg.file_glob)
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        for name in filenames:
            if match.match(prefix + name):
                found.append((prefix + name, Path(dirpath, name)))
    found.sort()
    budget = cfg.max_bytes
    files: list[SourceFile] = []
    for rel, path in found:
        if budget is not None and budget <= 0:
            break
        st = path.stat()
        n = st.st_size if budget is None else min(st.st_size, budget)
        files.append(SourceFile(path, rel, st.st_size, st.st_mtime_ns, n))
        if budget is not None:
            budget -= n
    if not files:
        raise CorpusError(
            f"no files match data.file_glob '{cfg.file_glob}' under '{root}'; "
            "check data.path and data.file_glob (e.g. '**/*.txt')"
        )
    return root, files


# --- cache key and layout ----------------------------------------------------------------------
def resolve_tokenizer_file(spec: str) -> Path:
    """`data.tokenizer` as a tokenizer.json path (a directory must hold one)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise CorpusError(
            f"data.tokenizer: '{p}' not found; give a tokenizer.json file or a directory "
            "holding one (or leave it unset to train a tokenizer on the corpus)"
        )
    return p


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_key(cfg: DataConfig, root: Path, files: list[SourceFile], tok_sha: str | None) -> str:
    """Hash of everything that determines the cached content."""
    spec = {
        "format_version": FORMAT_VERSION,
        "dataset": cfg.dataset,
        "root": str(root.resolve()),
        "files": [[f.rel, f.size, f.mtime_ns, f.read_bytes] for f in files],
        "vocab_size": None if tok_sha else cfg.vocab_size,
        "tokenizer_sha256": tok_sha,
        "val_fraction": cfg.val_fraction,
        "max_bytes": cfg.max_bytes,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def cache_root(cfg: DataConfig) -> Path:
    """cfg.cache_dir, else $SCALETRAIN_CACHE, else ~/.cache/scaletrain."""
    raw = cfg.cache_dir or os.environ.get("SCALETRAIN_CACHE") or "~/.cache/scaletrain"
    return Path(raw).expanduser()


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def _load_entry(entry: Path) -> TokenizedCorpus | None:
    """The cached corpus in `entry`, or None when it is missing or incomplete."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format_version") != FORMAT_VERSION:
        return None
    dtype = np.dtype(meta["dtype"])
    arrays = []
    for split in ("train", "val"):
        path = entry / f"{split}.bin"
        n = meta[f"{split}_tokens"]
        if not path.is_file() or path.stat().st_size != n * dtype.itemsize:
            return None
        arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(n,)))
    return TokenizedCorpus(
        train=arrays[0],
        val=arrays[1],
        tokenizer_path=entry / "tokenizer.json",
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
    )


def _remove_stale_tmp(root: Path) -> None:
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


# --- building ----------------------------------------------------------------------------------
def _read_documents(files: list[SourceFile]) -> tuple[list[str], list[str]]:
    """(texts, relative paths) of the non-blank files; undecodable bytes become U+FFFD."""
    texts, names = [], []
    for f in files:
        with open(f.path, "rb") as fh:
            text = fh.read(f.read_bytes).decode("utf-8", errors="replace")
        if text.strip():
            texts.append(text)
            names.append(f.rel)
    return texts, names


def split_documents(sizes: list[int], val_fraction: float) -> np.ndarray:
    """Sorted indices of the validation documents (`sizes` are the documents' lengths).

    Documents are taken in a fixed-seed random order until the split holds `val_fraction` of
    the documents and at least that share of the text (so a few tiny files cannot make a
    uselessly small validation set); each split keeps at least one document.
    """
    n_docs = len(sizes)
    if n_docs < 2:
        raise CorpusError(
            f"the corpus has {n_docs} non-empty document(s); at least 2 are needed (one for "
            "training, one for validation): add files or raise data.max_bytes"
        )
    if not 0 < val_fraction < 1:
        raise CorpusError(f"data.val_fraction must be in (0, 1) (got {val_fraction})")
    order = np.random.default_rng(_SPLIT_SEED).permutation(n_docs)
    want_docs = max(1, round(n_docs * val_fraction))
    want_size = val_fraction * sum(sizes)
    n_val, size = 0, 0
    while n_val < n_docs - 1 and (n_val < want_docs or size < want_size):
        size += sizes[order[n_val]]
        n_val += 1
    return np.sort(order[:n_val])


def train_tokenizer(texts: list[str], vocab_size: int, progress: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer with `<|endoftext|>` as its only special token.

    No normalizer and no prefix space, so `decode(encode(x)) == x` for any text.
    """
    n_base = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < n_base:
        raise CorpusError(
            f"data.vocab_size must be at least {n_base} (256 bytes + {EOS_TOKEN}); got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def find_eos_id(tok: Tokenizer, source: Path) -> int:
    for name in _EOS_CANDIDATES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    raise CorpusError(
        f"data.tokenizer: '{source}' has none of the end-of-document tokens "
        f"{', '.join(_EOS_CANDIDATES)}; add one as a special token"
    )


def _chunks(texts: list[str], max_chars: int) -> Iterator[tuple[int, int]]:
    start, size = 0, 0
    for i, t in enumerate(texts):
        size += len(t)
        if size >= max_chars:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(texts):
        yield start, len(texts)


def tokenize_documents(tok: Tokenizer, texts: list[str], progress: bool) -> list[np.ndarray]:
    """Token ids per document (no special tokens added), encoded in parallel by `tokenizers`."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    total = sum(len(t) for t in texts)
    out: list[np.ndarray] = []
    bar = None
    if progress and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import Progress

        bar = Progress(console=Console(stderr=True), transient=True)
        bar.start()
        task = bar.add_task("tokenizing", total=total)
    done, next_log, t0 = 0, 0.1, time.perf_counter()
    try:
        for a, b in _chunks(texts, _CHUNK_BYTES):
            encs = encode(texts[a:b], add_special_tokens=False)
            out.extend(np.asarray(e.ids, dtype=np.int32) for e in encs)
            done += sum(len(t) for t in texts[a:b])
            if bar is not None:
                bar.update(task, completed=done)
            elif progress and done >= next_log * total:
                log.info(
                    "tokenizing: %3.0f%% of %.1f MB (%.1fs)",
                    100 * done / total,
                    total / 1e6,
                    time.perf_counter() - t0,
                )
                next_log += 0.1
    finally:
        if bar is not None:
            bar.stop()
    return out


def _write_stream(path: Path, docs: list[np.ndarray], eos_id: int, dtype: np.dtype) -> int:
    """Write documents each followed by EOS; returns the number of tokens written."""
    eos = np.array([eos_id], dtype=dtype)
    n = 0
    with open(path, "wb") as f:
        for d in docs:
            d.astype(dtype).tofile(f)
            eos.tofile(f)
            n += len(d) + 1
    return n


def _build(
    cfg: DataConfig,
    root: Path,
    files: list[SourceFile],
    tok_file: Path | None,
    tmp: Path,
    key: str,
    progress: bool,
) -> dict:
    """Write train.bin, val.bin, tokenizer.json and (last) meta.json into `tmp`."""
    t0 = time.perf_counter()
    texts, names = _read_documents(files)
    n_bytes = sum(f.read_bytes for f in files)
    log.info(
        "read %d files (%d non-empty documents, %.1f MB) in %.2fs",
        len(files),
        len(texts),
        n_bytes / 1e6,
        time.perf_counter() - t0,
    )
    val_idx = split_documents([len(t) for t in texts], cfg.val_fraction)
    is_val = np.zeros(len(texts), dtype=bool)
    is_val[val_idx] = True

    t1 = time.perf_counter()
    if tok_file is None:
        train_texts = [t for t, v in zip(texts, is_val) if not v]
        tok = train_tokenizer(train_texts, cfg.vocab_size, progress and sys.stderr.isatty())
        log.info(
            "trained byte-level BPE tokenizer (vocab %d) on %d documents in %.1fs",
            tok.get_vocab_size(),
            len(train_texts),
            time.perf_counter() - t1,
        )
        tok.save(str(tmp / "tokenizer.json"))
    else:
        tok = Tokenizer.from_file(str(tok_file))
        shutil.copyfile(tok_file, tmp / "tokenizer.json")
        log.info("using tokenizer %s (vocab %d)", tok_file, tok.get_vocab_size())
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_id = find_eos_id(tok, tok_file or tmp / "tokenizer.json")
    dtype = _token_dtype(vocab_size)

    t2 = time.perf_counter()
    ids = tokenize_documents(tok, texts, progress)
    n_train = _write_stream(
        tmp / "train.bin", [d for d, v in zip(ids, is_val) if not v], eos_id, dtype
    )
    n_val = _write_stream(tmp / "val.bin", [d for d, v in zip(ids, is_val) if v], eos_id, dtype)
    dt = time.perf_counter() - t2
    log.info(
        "tokenized %d tokens (train %d, val %d) in %.1fs: %.0f tokens/s, %.2f bytes/token",
        n_train + n_val,
        n_train,
        n_val,
        dt,
        (n_train + n_val) / max(dt, 1e-9),
        n_bytes / max(n_train + n_val, 1),
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "dataset": cfg.dataset,
        "root": str(root),
        "file_glob": cfg.file_glob,
        "max_bytes": cfg.max_bytes,
        "val_fraction": cfg.val_fraction,
        "files": len(files),
        "bytes": n_bytes,
        "documents": len(texts),
        "val_documents": [names[i] for i in val_idx],
        "train_tokens": n_train,
        "val_tokens": n_val,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "eos_token": tok.id_to_token(eos_id),
        "tokenizer_source": str(tok_file) if tok_file else "trained",
        "build_seconds": round(time.perf_counter() - t0, 3),
        "created": time.time(),
    }
    # meta.json last: its presence (with matching .bin sizes) is what marks an entry complete.
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def prepare_corpus(cfg: DataConfig, progress: bool = True) -> TokenizedCorpus:
    """The tokenized corpus for `cfg`, built on first use and loaded from the cache after."""
    t0 = time.perf_counter()
    root, files = discover_files(cfg)
    tok_file = resolve_tokenizer_file(cfg.tokenizer) if cfg.tokenizer else None
    key = cache_key(cfg, root, files, _sha256_file(tok_file) if tok_file else None)
    base = cache_root(cfg)
    entry = base / f"{cfg.dataset}-{key}"
    corpus = _load_entry(entry)
    if corpus is not None:
        log.info(
            "corpus from cache %s: %d files, train %d tokens, val %d tokens (%.3fs)",
            entry,
            len(files),
            len(corpus.train),
            len(corpus.val),
            time.perf_counter() - t0,
        )
        return corpus
    if entry.exists():
        log.warning("cache entry %s is incomplete; rebuilding it", entry)
        shutil.rmtree(entry, ignore_errors=True)
    log.info(
        "building corpus cache %s from %d files under %s (found in %.2fs)",
        entry,
        len(files),
        root,
        time.perf_counter() - t0,
    )
    base.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(base)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=base))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished entry is shared like its parent
    try:
        _build(cfg, root, files, tok_file, tmp, key, progress)
        try:
            os.rename(tmp, entry)
        except OSError:
            if _load_entry(entry) is None:  # not another builder winning the race
                raise
            log.info("another process finished %s first; using its copy", entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    corpus = _load_entry(entry)
    if corpus is None:  # pragma: no cover - only if the entry vanished right after the rename
        raise CorpusError(f"corpus cache {entry} disappeared while loading; run again")
    log.info("corpus ready in %.1fs: %s", time.perf_counter() - t0, entry)
    return corpus
