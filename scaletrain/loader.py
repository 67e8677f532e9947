"""Deprecated: moved to `scaletrain.inference.loader` (see docs/api.md)."""

from scaletrain._moved import alias

alias(__name__, "scaletrain.inference.loader")
