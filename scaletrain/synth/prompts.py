"""Prompts from a template filled with seed data, drawn by a seeded sampler.

The template uses `{name}` slots (`str.format` syntax; `{{`/`}}` for literal braces). Each slot
draws from a list (given inline or read from a file: `.txt` one value per line, `.jsonl` the
`text` field of each record); `{examples}` is filled with `fewshot_k` few-shot examples joined
by a blank line. The same seed and inputs give the same prompts, so a resumed run rebuilds
exactly the prompt list it started with; each prompt has a stable id and its slot values.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PromptTask:
    id: str
    prompt: str
    slots: dict[str, str] = field(default_factory=dict)

    def fingerprint(self) -> str:
        return hashlib.sha1(self.prompt.encode()).hexdigest()[:12]


def read_values(path: str | Path) -> list[str]:
    """Seed values from a file: `.jsonl` -> each record's `text`, anything else -> lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"seed file {path} does not exist")
    if path.suffix == ".jsonl":
        out = []
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{k}: not JSON ({e})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise ValueError(f"{path}:{k}: expected an object with a string 'text'")
                out.append(rec["text"])
        values = out
    else:
        values = [v.strip() for v in path.read_text().splitlines() if v.strip()]
    if not values:
        raise ValueError(f"seed file {path} holds no values")
    return values


def template_fields(template: str) -> list[str]:
    names = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None and name not in names:
            if not name.isidentifier():
                raise ValueError(f"template slot '{{{name}}}' must be a plain name like {{topic}}")
            names.append(name)
    return names


def build_prompts(template: str, slots: dict[str, list[str]], num_prompts: int, seed: int = 0,
                  examples: list[str] | None = None, fewshot_k: int = 0,
                  id_prefix: str = "p") -> list[PromptTask]:
    """`num_prompts` prompts; slot values drawn uniformly with `random.Random(seed)`.

    With a single slot and `num_prompts` equal to its size, every value is used once.
    """
    fields = template_fields(template)
    missing = [f for f in fields if f not in slots and f != "examples"]
    if missing:
        raise ValueError(f"template slots {missing} have no values: give them under "
                         f"[prompts.slots] or [prompts.slot_files] (have {sorted(slots)})")
    if "examples" in fields and (not examples or fewshot_k < 1):
        raise ValueError("the template uses {examples}: set prompts.fewshot_file and "
                         "prompts.fewshot_k >= 1")
    for name, vals in slots.items():
        if not vals:
            raise ValueError(f"slot '{name}' has no values")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1 (got {num_prompts})")
    rng = random.Random(seed)
    tasks = []
    for i in range(num_prompts):
        chosen = {f: rng.choice(slots[f]) for f in fields if f != "examples"}
        values: dict[str, Any] = dict(chosen)
        if "examples" in fields and examples:
            values["examples"] = "\n\n".join(rng.sample(examples, min(fewshot_k, len(examples))))
        tasks.append(PromptTask(f"{id_prefix}{i:06d}", template.format(**values), chosen))
    return tasks
