"""A directory of text files -> a byte-level BPE tokenizer and two cached token streams.

`prepare_corpus(cfg)` finds the corpus files (the Python standard library's own sources by
default), trains a tokenizer (or loads `cfg.tokenizer`), tokenizes every document, holds out
whole documents for validation and writes two Megatron indexed datasets (`train.bin/.idx`,
`val.bin/.idx`, one document per file, each ending with EOS), `tokenizer.json` and `meta.json`
into a cache directory whose name is a hash of everything that determines their content. A
later call with the same inputs only maps the cached arrays (well under a second).

Cache entries are built in a temporary directory and renamed into place when complete, so an
interrupted build never leaves an entry that looks whole, and two processes building the same
entry at once both end up reading one complete copy.

The training loader reads the two indexed datasets like any other (`data.paths`).
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from scaletrain.config import DataConfig
from scaletrain.curate.builtin_corpus import curate_documents, curation_spec
from scaletrain.data import tokenizer as tokmod
from scaletrain.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from scaletrain.data.tokenize import write_texts
from scaletrain.data.tokenizer import TextTokenizer, TokenizerError

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: indexed datasets (train.bin/.idx, val.bin/.idx)
# Directories never read from the standard library (installed packages are not the stdlib).
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# The test suites: 60% of the stdlib's ~31 MB, with deliberately odd fixtures (legacy
# encodings, invalid syntax); some distributions ship them as a separate package.
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SPLIT_SEED = 20240517  # fixed: the validation documents depend only on the corpus
_STALE_TMP_SECONDS = 24 * 3600


class CorpusError(ValueError):
    """A corpus that cannot be built; the message names the input and the fix."""


@dataclass
class TokenizedCorpus:
    """The token streams of one cached corpus.

    `train` and `val` are the token arrays (read-only 1-D memory maps, uint16 when the
    vocabulary fits, else int32) of the indexed datasets at `train_prefix` / `val_prefix`;
    every document is followed by `eos_id`. `vocab_size` is the size of the tokenizer's
    vocabulary, special tokens included: every id is below it.
    """

    train: np.ndarray
    val: np.ndarray
    tokenizer_path: Path
    vocab_size: int
    eos_id: int
    train_prefix: Path
    val_prefix: Path

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
    try:
        return tokmod.resolve_tokenizer_file(spec)
    except TokenizerError as e:
        raise CorpusError(str(e)) from None


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
        "curation": curation_spec() if cfg.curate else None,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def cache_root(cfg: DataConfig) -> Path:
    """cfg.cache_dir, else $SCALETRAIN_CACHE, else ~/.cache/scaletrain."""
    raw = cfg.cache_dir or os.environ.get("SCALETRAIN_CACHE") or "~/.cache/scaletrain"
    return Path(raw).expanduser()


_token_dtype = tokmod.token_dtype


def _load_entry(entry: Path) -> TokenizedCorpus | None:
    """The cached corpus in `entry`, or None when it is missing or incomplete."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format_version") != FORMAT_VERSION:
        return None
    sets = []
    for split in ("train", "val"):
        try:
            ds = IndexedDataset(entry / split)
        except IndexedDatasetError:
            return None
        if ds.num_tokens != meta[f"{split}_tokens"]:
            return None
        sets.append(ds)
    return TokenizedCorpus(
        train=sets[0].tokens,
        val=sets[1].tokens,
        tokenizer_path=entry / "tokenizer.json",
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        train_prefix=entry / "train",
        val_prefix=entry / "val",
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
    """A byte-level BPE tokenizer with `<|endoftext|>` as its only special token."""
    try:
        return tokmod.train_bpe(texts, vocab_size, progress, length=len(texts))
    except TokenizerError as e:
        raise CorpusError(f"data.{e}") from None


def _write_split(prefix: Path, tok: TextTokenizer, texts: list[str], progress: bool) -> int:
    """One indexed dataset of `texts` (each followed by EOS); returns its token count."""
    with IndexedDatasetWriter(prefix, tok.dtype) as w:
        stats = write_texts(tok, texts, w)
    if progress:
        log.info("wrote %s: %d documents, %d tokens", prefix.name, stats.documents, stats.tokens)
    return stats.tokens


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
    curation = None
    if cfg.curate:
        n_read = len(texts)
        texts, names, curation = curate_documents(texts, names, tmp / "curation")
        shutil.rmtree(tmp / "curation", ignore_errors=True)
        if len(texts) < 2 <= n_read:
            raise CorpusError(
                f"curation kept {len(texts)} of {n_read} documents (dropped: "
                f"{curation['dropped']}); at least 2 are needed: add files or set "
                "data.curate false"
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
    try:
        text_tok = TextTokenizer.wrap(tok, tok_file or tmp / "tokenizer.json")
    except TokenizerError as e:
        raise CorpusError(f"data.{e}") from None
    vocab_size, eos_id, dtype = text_tok.vocab_size, text_tok.eos_id, text_tok.dtype

    t2 = time.perf_counter()
    n_train = _write_split(tmp / "train", text_tok, [t for t, v in zip(texts, is_val) if not v],
                           progress)
    n_val = _write_split(tmp / "val", text_tok, [t for t, v in zip(texts, is_val) if v], progress)
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
        "curation": curation,
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
