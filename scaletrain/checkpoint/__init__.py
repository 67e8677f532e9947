"""Checkpoint files, below everything that reads or writes them: the native format (DCP shards
+ `meta.json`, `native_format`), content hashes and finite-value checks (`integrity`) and DCP
reading without unrestricted unpickling (`safe_dcp`).

The trainer's stateful checkpointer (what to save when, resume) is `train.checkpoint`; the loader
that turns any model directory into a model is `inference.loader`.
"""
