"""Local and fsspec paths: expanding inputs, opening (de)compressed streams, atomic renames."""

from __future__ import annotations

import glob
import gzip
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from scaletrain.curate.io.errors import InputError
from scaletrain.curate.io.manifest import curated_files
from scaletrain.optional import require

# Suffixes read as documents of each format (checked after stripping .gz/.zst).
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
WARC_SUFFIXES = (".warc", ".arc")
# Common Crawl names WET files (extracted text in WARC `conversion` records) `*.warc.wet.gz`
WET_SUFFIXES = (".wet",)
HTML_SUFFIXES = (".html", ".htm")
COMPRESSIONS = (".gz", ".zst")
# Files in an input directory that are never documents.
SKIP_NAMES = frozenset({"stats.json", "_SUCCESS", "report.html"})
# Directories never read: caches and a pipeline's own work and dropped-document folders.
SKIP_DIRS = frozenset({"__pycache__", "_work", "_dropped"})


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _fsspec() -> Any:
    return require("fsspec", "remote paths need fsspec: pip install 'scaletrain[curate]' (plus "
                             "s3fs/gcsfs)", InputError)


def compression_of(path: str) -> str | None:
    for c in COMPRESSIONS:
        if path.endswith(c):
            return c[1:]
    return None


def format_of(path: str) -> str:
    """'jsonl', 'parquet', 'warc', 'wet', 'html' or 'text' (any other file: one document per
    file)."""
    name = path.lower()
    comp = compression_of(name)
    if comp:
        name = name[: -len(comp) - 1]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(WARC_SUFFIXES):
        return "warc"
    if name.endswith(WET_SUFFIXES):
        return "wet"
    if name.endswith(HTML_SUFFIXES):
        return "html"
    return "text"


def _walk_local(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.startswith(".") and name not in SKIP_NAMES and ".tmp" not in name:
                yield os.path.join(dirpath, name)


def expand_inputs(spec: str | list[str]) -> list[str]:
    """A file, a directory (walked recursively, hidden entries skipped) or a glob -> files.

    A curated folder (one with a `manifest.json`) gives the kept shards its manifest lists.

    Several specs may be given as a list. The result is sorted per spec and never empty.
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for s in specs:
        found: list[str]
        if is_url(s):
            fs, _, paths = _fsspec().get_fs_token_paths(s)
            proto = s.split("://", 1)[0]
            found = []
            for p in sorted(paths):
                if fs.isdir(p):
                    found += sorted(f for f in fs.find(p) if not Path(f).name.startswith("."))
                else:
                    found.append(p)
            found = [f if "://" in f else f"{proto}://{f}" for f in found]
        else:
            p = Path(s).expanduser()
            if p.is_dir():
                kept = curated_files(str(p))  # a curated folder: its kept shards only
                if kept == []:
                    raise InputError(
                        f"'{s}' is a finished curation run that kept 0 documents; its "
                        "stats.json says what each step dropped (loosen the pipeline)")
                found = kept if kept is not None else list(_walk_local(p))
            elif p.is_file():
                found = [str(p)]
            else:
                found = sorted(f for f in glob.glob(str(p), recursive=True) if os.path.isfile(f))
        if not found:
            raise InputError(
                f"input '{s}' matches no file; give a file, a directory or a glob "
                "such as 'data/*.jsonl.gz'"
            )
        out += found
    return out


def file_size(path: str) -> int:
    if is_url(path):
        return int(_fsspec().filesystem(path.split("://", 1)[0]).size(path))
    return os.path.getsize(path)


def open_raw(path: str, mode: str = "rb") -> IO[bytes]:
    """The file's bytes as stored (no decompression)."""
    try:
        if is_url(path):
            return _fsspec().open(path, mode).open()
        return open(path, mode)  # noqa: SIM115 - the caller closes it
    except OSError as e:
        raise InputError(f"cannot open '{path}': {e}") from e


def open_decompressed(path: str) -> IO[bytes]:
    """A binary stream of the file's content, decompressed by suffix (.gz, .zst)."""
    raw = open_raw(path)
    comp = compression_of(path)
    if comp == "gz":
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    if comp == "zst":
        try:
            import zstandard
        except ImportError as e:
            raise InputError(f"'{path}' is zstd-compressed: pip install zstandard") from e
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


def makedirs(path: str) -> None:
    if is_url(path):
        _fsspec().filesystem(path.split("://", 1)[0]).makedirs(path, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_url(base) else os.path.join(base, *parts)


def exists(path: str) -> bool:
    if is_url(path):
        return bool(_fsspec().filesystem(path.split("://", 1)[0]).exists(path))
    return os.path.exists(path)


def rename(src: str, dst: str) -> None:
    """Move a completed file into place (atomic on local filesystems)."""
    if is_url(src):
        _fsspec().filesystem(src.split("://", 1)[0]).mv(src, dst)
    else:
        os.replace(src, dst)


def remove(path: str) -> None:
    if is_url(path):
        fs = _fsspec().filesystem(path.split("://", 1)[0])
        if fs.exists(path):
            fs.rm(path)
    elif os.path.exists(path):
        os.remove(path)
