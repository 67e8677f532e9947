"""The `data synth` configuration: TOML sections [generator], [judge], [prompts], [filters].

Unknown keys are errors that list the allowed ones. See docs/synth.md for an example.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class GeneratorConfig:
    checkpoint: str = ""  # in-process: a checkpoint directory (HF, native or run dir)
    url: str = ""  # or an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1
    model: str = "default"  # model name sent to the server
    chat: bool = False  # prompt = one user message, in the chat format (HTTP: /v1/chat/completions)
    device: str = "cpu"
    batch_size: int = 16  # in-process batch (prompts decoded together)
    concurrency: int = 4  # HTTP requests in flight
    timeout_s: float = 120.0
    max_retries: int = 4
    max_requests: int = 0  # HTTP request budget (0 = unlimited)
    token_budget: int = 0  # in-process generated-token budget (0 = unlimited)
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0  # 0 = off
    stop: list[str] = field(default_factory=list)


@dataclass
class JudgeConfig:
    kind: str = "llm"  # "llm" (LLM-as-judge), "classifier" (local HF model) or "none"
    checkpoint: str = ""  # judge model; empty checkpoint and url: the generator's model
    url: str = ""
    model: str = "default"
    chat: bool = False
    rubric: str = ""  # empty: the built-in rubric; must contain {prompt} and {candidate}
    scale_min: float = 1.0
    scale_max: float = 10.0
    max_new_tokens: int = 64
    classifier: str = ""  # kind = "classifier": a local HF sequence-classification directory
    label: str = ""  # its label whose probability is the score (empty: the last label)


@dataclass
class PromptsConfig:
    template: str = "Write a short, factual paragraph about {topic}."
    num_prompts: int = 16
    candidates: int = 2  # n candidates per prompt
    seed: int = 0
    slots: dict[str, list[str]] = field(default_factory=dict)
    slot_files: dict[str, str] = field(default_factory=dict)
    fewshot_file: str = ""
    fewshot_k: int = 0
    topic_slot: str = "topic"  # the slot whose shares are monitored ("" = none)


@dataclass
class FiltersConfig:
    min_score: float | None = None  # drop below this score (None: no threshold)
    drop_unparsable: bool = True  # drop candidates whose critique has no score
    min_chars: int = 1
    curation: list[dict[str, Any]] = field(default_factory=list)  # step specs, as in curate
    dedup: bool = True  # MinHash within the run
    dedup_corpus: list[str] = field(default_factory=list)  # and against these documents
    dedup_threshold: float = 0.7
    dedup_shingle: str = "word"
    dedup_ngram: int = 3
    decontaminate: list[str] = field(default_factory=list)  # evaluation files (jsonl/txt)
    decontam_ngram: int = 13


@dataclass
class SynthConfig:
    output: str = "runs/synth"
    chunk_prompts: int = 8  # prompts per generate/critique/write round (the resume unit)
    tasks: int = 1  # slices of the prompt list, run by the executor (each loads its generator)
    executor: str = "local"  # "local" (worker processes) or "ray"
    workers: int = 0  # local worker processes / Ray CPUs (0: the executor's default)
    ray_address: str = ""  # an existing Ray cluster (empty: start a local one)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    filters: FiltersConfig = field(default_factory=FiltersConfig)

    def validate(self) -> None:
        g = self.generator
        if bool(g.checkpoint) == bool(g.url):
            raise ValueError("set exactly one of generator.checkpoint (in-process) or "
                             "generator.url (an OpenAI-compatible server)")
        if self.judge.kind not in ("llm", "classifier", "none"):
            raise ValueError(f"judge.kind '{self.judge.kind}': use llm, classifier or none")
        if self.judge.kind == "classifier" and not self.judge.classifier:
            raise ValueError("judge.kind = 'classifier' needs judge.classifier = <model dir>")
        if self.prompts.candidates < 1:
            raise ValueError(f"prompts.candidates must be >= 1 (got {self.prompts.candidates})")
        if self.tasks < 1:
            raise ValueError(f"tasks must be >= 1 (got {self.tasks})")
        if self.executor not in ("local", "ray"):
            raise ValueError(f"executor '{self.executor}': use 'local' or 'ray'")
        if self.chunk_prompts < 1:
            raise ValueError(f"chunk_prompts must be >= 1 (got {self.chunk_prompts})")


def _fill(cls: type, data: dict[str, Any], where: str) -> Any:
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ValueError(f"[{where}]: unknown key(s) {unknown}; allowed: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        sub = names[k].default_factory if names[k].default_factory is not dataclasses.MISSING \
            else None
        if isinstance(v, dict) and sub is not None and dataclasses.is_dataclass(sub):
            kwargs[k] = _fill(sub, v, k)
        else:
            kwargs[k] = v
    return cls(**kwargs)


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> SynthConfig:
    """Read a TOML file (or start from defaults) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path} is not valid TOML: {e}") from None
    for key, value in (overrides or {}).items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    cfg = _fill(SynthConfig, data, "top level")
    cfg.validate()
    return cfg
