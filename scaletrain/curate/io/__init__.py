"""Document readers and writers (local paths or fsspec URLs)."""

from scaletrain.curate.io.paths import InputError, expand_inputs, format_of
from scaletrain.curate.io.readers import ReadReport, Shard, plan_shards, read_documents, read_shard
from scaletrain.curate.io.writers import JsonlWriter, ParquetWriter, ShardedWriter, make_writer

__all__ = [
    "InputError",
    "JsonlWriter",
    "ParquetWriter",
    "ReadReport",
    "Shard",
    "ShardedWriter",
    "expand_inputs",
    "format_of",
    "make_writer",
    "plan_shards",
    "read_documents",
    "read_shard",
]
