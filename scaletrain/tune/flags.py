"""`scaletrain train` arguments as an ordered mapping, so a trial's settings replace the user's
(`--section.field value ...`, `--section.field=value`, `--config NAME`)."""

from __future__ import annotations


def parse_flags(argv: list[str]) -> dict[str, list[str]]:
    """`--key v1 [v2 ...]` (a list field takes several values) -> {"--key": [v1, ...]}, in order.
    A value that starts with `--` is never taken as a value."""
    out: dict[str, list[str]] = {}
    key: str | None = None
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            key = name
            out[key] = [value] if eq else []
        elif key is None:
            raise ValueError(f"'{arg}' is not a --section.field flag or its value")
        else:
            out[key].append(arg)
    return out


def merge(base: list[str], *overrides: list[str]) -> list[str]:
    """`base` with every flag of `overrides` replacing the same flag (later ones win)."""
    merged = parse_flags(base)
    for argv in overrides:
        for key, values in parse_flags(argv).items():
            merged.pop(key, None)
            merged[key] = values
    return to_argv(merged)


def to_argv(flags: dict[str, list[str]]) -> list[str]:
    out: list[str] = []
    for key, values in flags.items():
        out += [key, *values]
    return out
