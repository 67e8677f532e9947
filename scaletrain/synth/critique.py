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

from scaletrain.inference.generators import Generator, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_RUBRIC = (
    "You are a strict reviewer. Rate the RESPONSE to the TASK from {lo} (useless) to {hi} "
    "(excellent) for correctness, relevance, clarity and completeness.\n\n"
    "TASK:\n{prompt}\n\nRESPONSE:\n{candidate}\n\n"
    "Give one sentence of justification, then a last line of the form 'Score: N'.\n"
)

_NUM = r"(-?\d+(?:\.\d+)?)"
_OF = r"(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?"
# The designated score: 'Score: N', 'Rating - N/10', '**Grade:** N out of 5' (the label decides;
# numbers elsewhere in the justification, such as "handles 1/2 of the cases", never count).
_LABELLED = re.compile(r"\b(?:score|rating|grade)\b\**\s*(?:is|of)?\s*[:=\-]?\s*\**\s*" + _NUM
                       + _OF, re.I)
_BARE = re.compile(r"\**\s*" + _NUM + _OF + r"\s*\**\.?")
_SCORE_KEYS = ("score", "rating", "grade")


def _scaled(num: str | float, den: str | None, lo: float, hi: float) -> float | None:
    """`num` on the judge's scale: 'N/M' and 'N out of M' with M != hi are rescaled to hi."""
    val = float(num)
    if den and float(den) > 0 and float(den) != hi:
        val = val / float(den) * hi
    return val if lo <= val <= hi else None


def _json_score(text: str, lo: float, hi: float) -> tuple[bool, float | None]:
    """(a JSON object with a score key was found, its score on the scale or None)."""
    for m in re.finditer(r"\{[^{}]*\}", text):
        try:
            obj = json.loads(m.group(0))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        key = next((k for k in obj if str(k).lower() in _SCORE_KEYS), None)
        if key is None:
            continue
        val = obj[key]
        if isinstance(val, str):  # {"score": "7"} or {"score": "7/10"}
            hit = _BARE.fullmatch(val.strip())
            return True, _scaled(hit.group(1), hit.group(2), lo, hi) if hit else None
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return True, _scaled(val, None, lo, hi)
        return True, None
    return False, None


def parse_score(reply: str, lo: float = 1, hi: float = 10) -> float | None:
    """The score in a judge's reply, or None when there is none in [lo, hi].

    Only the designated score counts, tried in order: a JSON object's "score" (or "rating")
    field, a number or a numeric string; the last labelled score ('Score: N', 'Rating: N/10',
    'Score: 3 out of 5'); a reply that is nothing but a number ('7', '7/10'). 'N/M' and
    'N out of M' with M other than the scale's top are rescaled to it (3 out of 5 -> 6 on 1..10).
    """
    text = reply.strip()
    found, val = _json_score(text, lo, hi)
    if found:
        return val
    hits = _LABELLED.findall(text)
    if hits:
        return _scaled(hits[-1][0], hits[-1][1], lo, hi)
    m = _BARE.fullmatch(text)
    return _scaled(m.group(1), m.group(2), lo, hi) if m else None


def check_rubric(rubric: str) -> None:
    """Fail before any generation if the rubric cannot be filled: it needs {prompt} and
    {candidate}; other braces must be doubled ({{ and }}) to be literal."""
    for slot in ("{prompt}", "{candidate}"):
        if slot not in rubric:
            raise ValueError(f"the judge rubric must contain {slot}")
    try:
        rubric.format(prompt="p", candidate="c", lo=1, hi=10)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"the judge rubric cannot be filled ({type(e).__name__}: {e}): it may "
                         "use {prompt}, {candidate}, {lo} and {hi}; write literal braces as "
                         "{{ and }} (e.g. {{\"score\": N}})") from None


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
        check_rubric(rubric)
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
        from scaletrain.curate.quality.hf_classifier import HFClassifierScorer

        self.scorer = HFClassifierScorer(model, label=label, batch_size=batch_size)
        self.batch_size, self.with_prompt = batch_size, with_prompt

    def critique(self, prompts: list[str], candidates: list[str]) -> list[Critique]:
        texts = [f"{p}\n\n{c}" if self.with_prompt else c for p, c in zip(prompts, candidates)]
        scores: list[float] = []
        for b in range(0, len(texts), self.batch_size):
            scores += self.scorer.scores(texts[b : b + self.batch_size])
        return [Critique(None, round(float(s), 5)) for s in scores]
