"""Optimizer state as the checkpointer writes it: every entry keyed by a parameter's name, the
group settings (learning rate, betas, weight decay, ...) too, as torchtitan's flat optimizer
state is. A rank then writes only keys of its own parameters, so under pipeline parallelism no
stage's entries hide another's (DCP keeps one copy of a key every rank writes: with positional
group lists, the saved `params` lists were one stage's and the other stages' parameters were
in no group on resume), and a checkpoint of any layout loads into any other.

Checkpoints written before this format (group settings in a positional list) still load: the
settings are taken by the group's position, the parameters from the live optimizer."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""torch's per-parameter optimizer state: `state.<name>.<key>`, `param_groups.<name>.<key>`."""

_POSITIONAL = re.compile(r"^optimizer\.param_groups\.\d+\.params$")


def positional_groups(saved_keys: Iterable[str]) -> bool:
    """Whether a checkpoint (its DCP keys) keeps group settings in a positional list."""
    return any(_POSITIONAL.match(k) for k in saved_keys)


def settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings, without its parameter list."""
    return {k: v for k, v in group.items() if k != "params"}


def settings_by_name(groups: list[dict[str, Any]], names: list[list[str]]
                     ) -> dict[str, dict[str, Any]]:
    """{parameter name: its group's settings} for groups whose parameters are `names`."""
    return {n: settings(g) for g, ns in zip(groups, names, strict=True) for n in ns}


def group_settings(saved: dict[str, Any] | list[dict[str, Any]], names: list[list[str]]
                   ) -> list[dict[str, Any]]:
    """The settings of each live group (its parameters are `names`) from a saved state: keyed
    by parameter name (the settings of the group's first parameter), or a positional list."""
    if isinstance(saved, list):
        if len(saved) != len(names):
            raise ValueError(f"optimizer state has {len(saved)} parameter groups, this run "
                             f"{len(names)}: resume with the optimizer settings it was saved "
                             "with")
        return [settings(g) for g in saved]
    out = []
    for ns in names:
        found = next((saved[n] for n in ns if n in saved), None)
        if found is None and ns:
            raise KeyError(f"optimizer state has no group settings for {ns[:3]}")
        out.append(dict(found or {}))
    return out


def positional_template(optim_sd: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A name-keyed optimizer state re-laid as a positional checkpoint stores it, to load one
    (settings of each group by position, no parameter lists)."""
    groups = optim_sd["param_groups"]
    return {**optim_sd, "param_groups": [dict(groups[ns[0]]) if ns else {} for ns in names]}


def torch_state(model: nn.Module, optimizer: torch.optim.Optimizer, positional: bool = False
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state) of a torch optimizer for DCP: per parameter (`FLAT`), or
    with `positional` laid out as an older checkpoint stores it (to load one)."""
    if not positional:
        return get_state_dict(model, optimizer, options=FLAT)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_sd["param_groups"] = [settings(g) for g in optim_sd["param_groups"]]
    return model_sd, optim_sd


def set_torch_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], positional: bool = False) -> None:
    """Put a loaded (model, optimizer) state of `torch_state` into place."""
    if not positional:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=FLAT)
        return
    _, live = get_state_dict(model, optimizer)  # this rank's parameter names per group
    optim_sd = dict(state["optimizer"])
    optim_sd["param_groups"] = [
        {**saved, "params": g["params"]}
        for saved, g in zip(group_settings(optim_sd["param_groups"],
                                           [g["params"] for g in live["param_groups"]]),
                            live["param_groups"], strict=True)]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd)
