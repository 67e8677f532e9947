"""Corpus curation, datatrove's shape: a pipeline is a list of blocks (`pipeline.Step`), each
does one thing and counts the documents it keeps and drops by reason.

`io` (readers/writers, local paths or fsspec URLs, WARC), `filters` (heuristics with their
published thresholds), `dedup` (exact, MinHash, semantic), `quality` (model scores), `pii`,
`executors` (local processes or Ray), `runner` (sharded, resumable runs), `registry` (blocks by
name, as configs and the CLI name them), `report`, and `builtin_corpus` (the rules that curate
the default training corpus). Nothing here imports the trainer.
"""
