"""Sharded JSON-lines and Parquet writers; every file is written under a temporary name and
renamed when complete, so an interrupted run never leaves a file that looks whole."""

from __future__ import annotations

import gzip
import json
from typing import IO, Any

from scaletrain.curate.documents import Document
from scaletrain.curate.io.paths import is_url, join, makedirs, open_raw, remove, rename

TMP_SUFFIX = ".tmp"


class ShardedWriter:
    """Writes documents to `DIR/PREFIX-NNNNN.EXT`, starting a new file after `max_bytes`.

    Use as a context manager: on a clean exit every file is renamed into place; on an
    exception the temporary files are removed.
    """

    ext = ".jsonl"

    def __init__(self, directory: str, prefix: str = "part", max_bytes: int = 256 << 20):
        self.directory, self.prefix, self.max_bytes = directory, prefix, max_bytes
        self.done: list[str] = []  # temporary names of closed files
        self.count = 0
        self.file_counts: list[int] = []  # documents per closed file, in file order
        self._in_file = 0
        self._n = 0
        self._bytes = 0
        self._open_name: str | None = None
        makedirs(directory)

    # -- to be provided by subclasses
    def _open(self, tmp_name: str) -> None:
        raise NotImplementedError

    def _write(self, doc: Document) -> int:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    # --
    def _name(self, i: int) -> str:
        return join(self.directory, f"{self.prefix}-{i:05d}{self.ext}")

    def write(self, doc: Document) -> None:
        if self._open_name is None:
            self._open_name = self._name(self._n) + TMP_SUFFIX
            self._open(self._open_name)
        self._bytes += self._write(doc)
        self.count += 1
        self._in_file += 1
        if self._bytes >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        if self._open_name is not None:
            self._close()
            self.done.append(self._open_name)
            self.file_counts.append(self._in_file)
            self._open_name, self._bytes, self._in_file = None, 0, 0
            self._n += 1

    def close(self) -> list[str]:
        """Finish: rename every file into place; returns the final names."""
        self._rotate()
        final = []
        for tmp in self.done:
            rename(tmp, tmp[: -len(TMP_SUFFIX)])
            final.append(tmp[: -len(TMP_SUFFIX)])
        self.done = []
        return final

    def abort(self) -> None:
        if self._open_name is not None:
            try:
                self._close()
            finally:
                self.done.append(self._open_name)
                self._open_name = None
        for tmp in self.done:
            remove(tmp)
        self.done = []

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class JsonlWriter(ShardedWriter):
    """JSON lines `{"id", "text", "metadata"}`; `compression` None, 'gz' or 'zst'."""

    def __init__(
        self,
        directory: str,
        prefix: str = "part",
        max_bytes: int = 256 << 20,
        compression: str | None = None,
    ):
        self.ext = ".jsonl" + (f".{compression}" if compression else "")
        self.compression = compression
        self._f: IO[bytes] | None = None
        self._raw: IO[bytes] | None = None
        super().__init__(directory, prefix, max_bytes)

    def _open(self, tmp_name: str) -> None:
        self._raw = open_raw(tmp_name, "wb") if is_url(tmp_name) else open(tmp_name, "wb")  # noqa: SIM115
        if self.compression == "gz":
            self._f = gzip.GzipFile(fileobj=self._raw, mode="wb", mtime=0)  # type: ignore[assignment]
        elif self.compression == "zst":
            import zstandard

            self._f = zstandard.ZstdCompressor().stream_writer(self._raw)  # type: ignore[assignment]
        else:
            self._f = self._raw

    def _write(self, doc: Document) -> int:
        assert self._f is not None
        line = (doc.to_json() + "\n").encode("utf-8")
        self._f.write(line)
        return len(line)

    def _close(self) -> None:
        assert self._f is not None and self._raw is not None
        self._f.close()
        if self._f is not self._raw and not self._raw.closed:
            self._raw.close()
        self._f = self._raw = None


class ParquetWriter(ShardedWriter):
    """Parquet with columns id, text, metadata (a JSON string); rows buffered per row group."""

    ext = ".parquet"

    def __init__(
        self,
        directory: str,
        prefix: str = "part",
        max_bytes: int = 256 << 20,
        row_group_rows: int = 4096,
    ):
        import pyarrow as pa

        self._pa = pa
        self._schema = pa.schema(
            [("id", pa.string()), ("text", pa.string()), ("metadata", pa.string())]
        )
        self.row_group_rows = row_group_rows
        self._rows: list[Document] = []
        self._pw: Any = None
        self._sink: IO[bytes] | None = None
        super().__init__(directory, prefix, max_bytes)

    def _open(self, tmp_name: str) -> None:
        import pyarrow.parquet as pq

        self._sink = open_raw(tmp_name, "wb")
        self._pw = pq.ParquetWriter(self._sink, self._schema)

    def _flush(self) -> None:
        if self._rows:
            cols = {
                "id": [d.id for d in self._rows],
                "text": [d.text for d in self._rows],
                "metadata": [json.dumps(d.metadata, ensure_ascii=False) for d in self._rows],
            }
            self._pw.write_table(self._pa.table(cols, schema=self._schema))
            self._rows = []

    def _write(self, doc: Document) -> int:
        self._rows.append(doc)
        if len(self._rows) >= self.row_group_rows:
            self._flush()
        return len(doc.text.encode("utf-8")) + 64

    def _close(self) -> None:
        self._flush()
        self._pw.close()
        assert self._sink is not None
        self._sink.close()
        self._pw = self._sink = None


def make_writer(
    directory: str, fmt: str = "jsonl", prefix: str = "part", max_bytes: int = 256 << 20
) -> ShardedWriter:
    """'jsonl', 'jsonl.gz', 'jsonl.zst' or 'parquet'."""
    if fmt == "parquet":
        return ParquetWriter(directory, prefix, max_bytes)
    if fmt in ("jsonl", "jsonl.gz", "jsonl.zst"):
        comp = fmt.split(".")[1] if "." in fmt else None
        return JsonlWriter(directory, prefix, max_bytes, compression=comp)
    raise ValueError(f"output format '{fmt}': use jsonl, jsonl.gz, jsonl.zst or parquet")
