"""Deprecated: moved to `scaletrain.checkpoint.safe_dcp` (see docs/api.md)."""

from scaletrain._moved import alias

alias(__name__, "scaletrain.checkpoint.safe_dcp")
