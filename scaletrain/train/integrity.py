"""Deprecated: moved to `scaletrain.checkpoint.integrity` (see docs/api.md)."""

from scaletrain._moved import alias

alias(__name__, "scaletrain.checkpoint.integrity")
