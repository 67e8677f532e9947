"""Deprecated: moved to `scaletrain.checkpoint.native_format` (see docs/api.md)."""

from scaletrain._moved import alias

alias(__name__, "scaletrain.checkpoint.native_format")
