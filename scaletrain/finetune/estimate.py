"""Deprecated: moved to `scaletrain.plan.finetune_estimate` (see docs/api.md)."""

from scaletrain._moved import alias

alias(__name__, "scaletrain.plan.finetune_estimate")
