"""Critique: LLM-as-judge with a rubric and a robust score parser, or a local classifier.

A judge reply that holds no score in range is *counted* (score None, `parse_failures`), never
an exception. Scores are stored as floats on the judge's scale (default 1..10).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Protocol

from scaletrain.data.synth.generators import Generator, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_RUBRIC = (
    "You are a strict reviewer. Rate the RESPONSE to the TASK from {lo} (useless) to {hi} "
    "(excellent) for correctness, relevance, clarity and completeness.\n\n"
    "TASK:\n{prompt}\n\nRESPONSE:\n{candidate}\n\n"
    "Give one sentence of justification, then a last line of the form 'Score: N'.\n"
)

_NUM = r"(-?\d+(?:\.\d+)?)"
_PATTERNS = [
    re.compile(r"\b(?:score|rating|grade)\b\s*(?:is|of)?\s*[:=]?\s*\**\s*" + _NUM
               + r"(?:\s*/\s*(\d+(?:\.\d+)?))?", re.I),
    re.compile(_NUM + r"\s*/\s*(\d+(?:\.\d+)?)"),
    re.compile(r"\b" + _NUM + r"\s+out\s+of\s+(\d+(?:\.\d+)?)", re.I),
]


def parse_score(reply: str, lo: float = 1, hi: float = 10) -> float | None:
    """The score in a judge's reply, or None when there is none in [lo, hi].

    Tried in order: a JSON object with "score"; the last 'Score: N' / 'Rating: N/10'; the last
    'N/M' or 'N out of M' (rescaled to `hi` when M differs); a reply that is just a number.
    """
    text = reply.strip()
    m = re.search(r"\{[^{}]*\}", text)
    if m:
        try:
            obj = json.loads(m.group(0))
            val = obj.get("score", obj.get("rating")) if isinstance(obj, dict) else None
            if isinstance(val, (int, float)) and not isinstance(val, bool) and lo <= val <= hi:
                return float(val)
        except json.JSONDecodeError:
            pass
    for pat in _PATTERNS:
        hits = pat.findall(text)
        if hits:
            num, den = hits[-1]
            val = float(num)
            if den and float(den) > 0 and float(den) != hi:
                val = val / float(den) * hi
            return val if lo <= val <= hi else None
    m = re.fullmatch(r"\**\s*" + _NUM + r"\s*\**\.?", text)
    if m:
        val = float(m.group(1))
        return val if lo <= val <= hi else None
    return None


@dataclass
class Critique:
    text: str | None  # the judge's reply (None for classifiers)
    score: float | None  # None: unparsable reply


class Critic(Protocol):
    name: str

    def critique(self, prompts: list[str], candidates: list[str]) -> list[Critique]: ...


class JudgeCritic:
    """LLM-as-judge: the rubric filled with {prompt}, {candidate}, {lo}, {hi}, decoded greedily
    by any generator (in-process or HTTP)."""

    name = "llm_judge"

    def __init__(self, generator: Generator, rubric: str = DEFAULT_RUBRIC, lo: float = 1,
                 hi: float = 10, max_new_tokens: int = 64, max_chars: int = 4000):
        for slot in ("{prompt}", "{candidate}"):
            if slot not in rubric:
                raise ValueError(f"the judge rubric must contain {slot}")
        if lo >= hi:
            raise ValueError(f"judge scale: scale_min {lo} must be below scale_max {hi}")
        self.generator, self.rubric, self.lo, self.hi = generator, rubric, lo, hi
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, top_p=None)
        self.max_chars = max_chars
        self.parse_failures = 0

    def critique(self, prompts: list[str], candidates: list[str]) -> list[Critique]:
        asks = [self.rubric.format(prompt=p[: self.max_chars], candidate=c[: self.max_chars],
                                   lo=self.lo, hi=self.hi) for p, c in zip(prompts, candidates)]
        out = []
        for comp in self.generator.complete(asks, self.params):
            score = parse_score(comp.text, self.lo, self.hi)
            if score is None:
                self.parse_failures += 1
            out.append(Critique(comp.text, score))
        return out


class ClassifierCritic:
    """A local reward / classifier model (Hugging Face directory) scoring in batches; the
    score is its regression output or the probability of `label`."""

    name = "classifier"

    def __init__(self, model: str, label: str | int | None = None, batch_size: int = 16,
                 with_prompt: bool = False):
        from scaletrain.data.quality.hf_classifier import HFClassifierScorer

        self.scorer = HFClassifierScorer(model, label=label, batch_size=batch_size)
        self.batch_size, self.with_prompt = batch_size, with_prompt

    def critique(self, prompts: list[str], candidates: list[str]) -> list[Critique]:
        texts = [f"{p}\n\n{c}" if self.with_prompt else c for p, c in zip(prompts, candidates)]
        scores: list[float] = []
        for b in range(0, len(texts), self.batch_size):
            scores += self.scorer.scores(texts[b : b + self.batch_size])
        return [Critique(None, round(float(s), 5)) for s in scores]
