"""Deprecated: moved to `scaletrain.inference.generation` (see docs/api.md)."""

from scaletrain._moved import alias

alias(__name__, "scaletrain.inference.generation")
