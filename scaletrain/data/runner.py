"""Deprecated: moved to `scaletrain.curate.runner` (see docs/api.md)."""

from scaletrain._moved import alias

alias(__name__, "scaletrain.curate.runner")
