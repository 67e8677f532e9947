"""Steps by name, for TOML pipelines and the CLI: `build_step({"type": "c4", ...})`."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from scaletrain.curate.pipeline import Step

# name -> "module:Class"; imported only when used (optional dependencies stay optional)
STEP_TYPES: dict[str, str] = {
    "gopher_quality": "scaletrain.curate.filters.gopher:GopherQualityFilter",
    "gopher_repetition": "scaletrain.curate.filters.gopher:GopherRepetitionFilter",
    "c4": "scaletrain.curate.filters.c4:C4Filter",
    "fineweb_quality": "scaletrain.curate.filters.fineweb:FineWebQualityFilter",
    "counts": "scaletrain.curate.filters.counts:CountsFilter",
    "code": "scaletrain.curate.filters.counts:CodeFilter",
    "language": "scaletrain.curate.filters.language:LanguageFilter",
    "url": "scaletrain.curate.filters.url:UrlFilter",
    "exact_dedup": "scaletrain.curate.dedup.exact:ExactDedup",
    "minhash_dedup": "scaletrain.curate.dedup.minhash:MinHashDedup",
    "semantic_dedup": "scaletrain.curate.dedup.semantic:SemanticDedup",
    "pii": "scaletrain.curate.pii:PIIRedactor",
    "fasttext_score": "scaletrain.curate.quality.fasttext_clf:FastTextScorer",
    "perplexity": "scaletrain.curate.quality.kenlm_ppl:PerplexityScorer",
    "hf_score": "scaletrain.curate.quality.hf_classifier:HFClassifierScorer",
    "score_filter": "scaletrain.curate.quality.threshold:ScoreFilter",
}
ALIASES = {
    "gopher": "gopher_quality",
    "repetition": "gopher_repetition",
    "fineweb": "fineweb_quality",
    "exact": "exact_dedup",
    "minhash": "minhash_dedup",
    "semantic": "semantic_dedup",
    "lang": "language",
}


def step_class(name: str) -> type[Step]:
    key = ALIASES.get(name, name)
    if key not in STEP_TYPES:
        import difflib

        near = difflib.get_close_matches(name, list(STEP_TYPES) + list(ALIASES), n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise ValueError(f"unknown step type '{name}'.{hint} Known: {', '.join(STEP_TYPES)}")
    module, cls = STEP_TYPES[key].split(":")
    return getattr(importlib.import_module(module), cls)


def build_step(spec: dict[str, Any]) -> Step:
    """A step from `{"type": NAME, **parameters}`; unknown parameters are a clear error."""
    spec = dict(spec)
    if "type" not in spec:
        raise ValueError(f"step {spec} has no 'type'; e.g. type = \"gopher_quality\"")
    kind = spec.pop("type")
    only = spec.pop("only", None)
    if only not in (None, "code", "web"):
        raise ValueError(f"step '{kind}': only = {only!r}; use \"code\" (source files and "
                         "text that is not prose) or \"web\" (WARC, WET, HTML, JSON lines, "
                         "Parquet documents and prose text files)")
    cls = step_class(kind)
    params = inspect.signature(cls.__init__).parameters
    unknown = [k for k in spec if k not in params]
    if unknown:
        allowed = [p for p in params if p != "self"]
        raise ValueError(f"step '{kind}': unknown parameter(s) {unknown}; allowed: {allowed}")
    try:
        step = cls(**spec)
    except TypeError as e:
        raise ValueError(f"step '{kind}': {e}") from e
    step.only = only
    return step


# The default pipeline for the default corpus (Python source files).
DEFAULT_CODE_PIPELINE: list[dict[str, Any]] = [
    {"type": "counts", "min_chars": 100, "max_chars": 1_000_000},
    {"type": "code"},
    {"type": "exact_dedup"},
    {"type": "minhash_dedup", "preset": "fineweb", "verify": True},
    {"type": "pii"},
]
# A web-text pipeline in the FineWeb order (language, quality rules, dedup, PII).
DEFAULT_WEB_PIPELINE: list[dict[str, Any]] = [
    {"type": "language", "languages": ["en"]},
    {"type": "gopher_repetition"},
    {"type": "gopher_quality"},
    {"type": "c4"},
    {"type": "fineweb_quality"},
    {"type": "exact_dedup"},
    {"type": "minhash_dedup", "preset": "fineweb"},
    {"type": "pii"},
]
_CODE_RULES = [s for s in DEFAULT_CODE_PIPELINE if s["type"] in ("counts", "code")]
_WEB_RULES = [s for s in DEFAULT_WEB_PIPELINE if not s["type"].endswith("_dedup")
              and s["type"] != "pii"]
# A source tree with some web documents in it: each kind of file gets its own rules, then
# one deduplication and PII pass over everything.
DEFAULT_MIXED_PIPELINE: list[dict[str, Any]] = [
    *({**s, "only": "code"} for s in _CODE_RULES),
    *({**s, "only": "web"} for s in _WEB_RULES),
    {"type": "exact_dedup"},
    {"type": "minhash_dedup", "preset": "fineweb", "verify": True},
    {"type": "pii"},
]


def default_pipeline_for(formats: dict[str, int]) -> tuple[list[dict[str, Any]], str]:
    """The default pipeline for input files counted by format ('text', 'prose', 'jsonl',
    'warc', ...) and one line that says the choice: code rules for source files and text
    that is not prose ('text'), web rules for web documents and prose text files, both
    (each on its own files) when the input holds both."""
    code = formats.get("text", 0)
    web = {f: n for f, n in sorted(formats.items()) if f != "text" and n}
    web_files = ", ".join(f"{n:,} {f}" for f, n in web.items())
    if code and web:
        return DEFAULT_MIXED_PIPELINE, (
            f"code rules for {code:,} source/text files, web rules for {sum(web.values()):,} "
            f"web-document files ({web_files}); then dedup and PII over all")
    if web:
        return DEFAULT_WEB_PIPELINE, f"web rules for {web_files} files"
    return DEFAULT_CODE_PIPELINE, f"code rules for {code:,} source/text files"
