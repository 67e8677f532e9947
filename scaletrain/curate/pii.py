"""PII and secret removal: typed placeholders replace e-mail addresses, public IP addresses,
phone numbers, Luhn-valid card numbers and common secrets (API keys, private-key blocks).

Each detector is a regular expression plus a validation that removes look-alikes: IP
addresses must parse and be globally routable (private, loopback, link-local, documentation
and other reserved ranges are kept) and not be part of a longer dotted number such as a
version; card numbers must pass the Luhn check and start with a card network's prefix;
phone numbers need separators in a phone layout and 10-15 digits (dates, times and versions
do not match); generic `key = "..."` secrets need a long value with high character entropy.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scaletrain.curate.documents import Document
from scaletrain.curate.pipeline import Step

PLACEHOLDERS = {
    "email": "<EMAIL>",
    "ip_address": "<IP_ADDRESS>",
    "phone": "<PHONE>",
    "credit_card": "<CREDIT_CARD>",
    "private_key": "<PRIVATE_KEY>",
    "secret": "<SECRET>",
}


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    kind: str


_EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
    r"[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![\w-])"
)
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_PHONE = re.compile(
    r"(?<![\w.+/-])(?<!\d )(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]"
    r"\d{3,4}(?![ .-]?\d)(?!\w)"
)
# 4-4-4-1..7 groups with one consistent separator (or none), or Amex 4-6-5
_CARD = re.compile(
    r"(?<![\d.,-])(?:\d{4}([ -]?)\d{4}\1\d{4}\1\d{1,7}|\d{4}([ -]?)\d{6}\2\d{5})"
    r"(?![.,-]?\d)(?! \d)"
)
_CARD_PREFIX = re.compile(r"^(?:4|5[1-5]|2[2-7]|3[47]|6(?:011|5)|3(?:0[0-5]|[68]))")
_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?-----END (?:[A-Z]+ )*PRIVATE"
    r" KEY(?: BLOCK)?-----"
)
_TOKENS = re.compile(
    r"\b(?:(?:AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}"  # AWS access key ids
    r"|gh[pousr]_[A-Za-z0-9]{36,}"  # GitHub tokens
    r"|github_pat_[A-Za-z0-9_]{40,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AIza[0-9A-Za-z_-]{35}"  # Google API keys
    r"|sk-(?:proj-|ant-)?[A-Za-z0-9_-]{32,}"  # OpenAI / Anthropic style
    r"|[sr]k_live_[0-9A-Za-z]{20,}"  # Stripe
    r"|hf_[A-Za-z0-9]{30,})\b"  # Hugging Face
)


def luhn_ok(digits: str) -> bool:
    total, odd = 0, False
    for ch in reversed(digits):
        d = ord(ch) - 48
        if odd:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
        odd = not odd
    return total % 10 == 0


def entropy(s: str) -> float:
    """Shannon entropy in bits per character."""
    counts = Counter(s)
    return -sum(c / len(s) * math.log2(c / len(s)) for c in counts.values())


def _public_ip(s: str) -> bool:
    try:
        return ipaddress.ip_address(s).is_global
    except ValueError:
        return False


# Cheap trigger patterns find candidate regions; the precise patterns above run only on a
# window around each (Python's regex engine is slow when a pattern with optional prefixes or
# lookbehinds is tried at every position of a long text).
_TRIG_DIGITS = re.compile(r"[0-9][0-9 ().+-]{8,}")
_TRIG_IPV4 = re.compile(r"[0-9]{1,3}\.[0-9][0-9.]{4,}")
_TRIG_IPV6 = re.compile(r":[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{0,4}:")
_TRIG_ASSIGN = re.compile(r"[:=]\s*[\"'][A-Za-z0-9/+=_\-.]{16,}[\"']")
_NOT_IP_CONTEXT = ("version", "section", "release", "rfc", "\u00a7")
_TOKEN_LITERALS = (
    "AKIA",
    "ASIA",
    "AGPA",
    "AIDA",
    "AROA",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "xoxa-",
    "xoxb-",
    "xoxp-",
    "xoxr-",
    "xoxs-",
    "AIza",
    "sk-",
    "k_live_",
    "hf_",
)


def _windowed(
    text: str, trigger: re.Pattern[str] | str, precise: re.Pattern[str], before: int, after: int
) -> Iterable[re.Match[str]]:
    """Matches of `precise` in windows around each `trigger` match (or literal), deduplicated.

    The window keeps `before`/`after` characters of context so lookarounds see the text."""
    seen: set[int] = set()
    if isinstance(trigger, str):
        starts, pos = [], text.find(trigger)
        while pos >= 0:
            starts.append((pos, pos + len(trigger)))
            pos = text.find(trigger, pos + 1)
    else:
        starts = [(m.start(), m.end()) for m in trigger.finditer(text)]
    for a, b in starts:
        lo, hi = max(0, a - before), min(len(text), b + after)
        for m in precise.finditer(text, lo, hi):
            # a match touching the window's end could not see what follows it: skip it (the
            # window is wider than any trigger match, so real matches end inside it)
            if m.start() not in seen and (m.end() < hi or hi == len(text)):
                seen.add(m.start())
                yield m


def _emails(text: str) -> Iterable[Span]:
    for m in _windowed(text, "@", _EMAIL, 66, 256):
        yield Span(m.start(), m.end(), "email")


def _ips(text: str) -> Iterable[Span]:
    for m in _windowed(text, _TRIG_IPV4, _IPV4, 1, 1):
        before = text[max(0, m.start() - 12) : m.start()].lower()
        if any(w in before for w in _NOT_IP_CONTEXT) or before.endswith(("v", "v.")):
            continue  # a version or section number, not an address
        if _public_ip(m.group()):
            yield Span(m.start(), m.end(), "ip_address")
    for m in _windowed(text, _TRIG_IPV6, _IPV6, 40, 40):
        s = m.group()
        if s.count(":") >= 3 and sum(c.isdigit() for c in s) and _public_ip(s):
            yield Span(m.start(), m.end(), "ip_address")


def _phones(text: str) -> Iterable[Span]:
    for m in _windowed(text, _TRIG_DIGITS, _PHONE, 3, 1):
        n = sum(c.isdigit() for c in m.group())
        if 10 <= n <= 15:
            yield Span(m.start(), m.end(), "phone")


def _cards(text: str) -> Iterable[Span]:
    for m in _windowed(text, _TRIG_DIGITS, _CARD, 1, 1):
        digits = re.sub(r"\D", "", m.group())
        if 13 <= len(digits) <= 19 and _CARD_PREFIX.match(digits) and luhn_ok(digits):
            yield Span(m.start(), m.end(), "credit_card")


_KEY_NAME = re.compile(
    r"(?i)(?:aws_secret_access_key|secret(?:_key)?|api[_-]?key|access[_-]?token|auth[_-]?token"
    r"|password|passwd|client_secret)[\"']?\s*$"
)


def _secrets(text: str) -> Iterable[Span]:
    if "PRIVATE KEY" in text:
        for m in _PRIVATE_KEY.finditer(text):
            yield Span(m.start(), m.end(), "private_key")
    if any(lit in text for lit in _TOKEN_LITERALS):
        for m in _TOKENS.finditer(text):
            yield Span(m.start(), m.end(), "secret")
    for m in _TRIG_ASSIGN.finditer(text):
        if not _KEY_NAME.search(text, max(0, m.start() - 40), m.start()):
            continue
        q = m.group().lstrip(":= \t")[0]
        start = text.index(q, m.start()) + 1
        value = text[start : m.end() - 1]
        if entropy(value) >= 3.5 and any(c.isdigit() for c in value):
            yield Span(start, m.end() - 1, "secret")


DETECTORS: dict[str, Callable[[str], Iterable[Span]]] = {
    "secret": _secrets,  # first: wins overlaps (a key may contain digit runs, '@', ...)
    "email": _emails,
    "credit_card": _cards,
    "ip_address": _ips,
    "phone": _phones,
}


def find_pii(text: str, kinds: Iterable[str] = tuple(DETECTORS)) -> list[Span]:
    """Non-overlapping spans in text order; earlier detectors win overlaps."""
    taken: list[Span] = []
    for kind in kinds:
        if kind not in DETECTORS:
            raise ValueError(f"PII kind '{kind}': use some of {sorted(DETECTORS)}")
        for sp in DETECTORS[kind](text):
            if all(sp.end <= t.start or sp.start >= t.end for t in taken):
                taken.append(sp)
    return sorted(taken, key=lambda s: s.start)


def redact(text: str, kinds: Iterable[str] = tuple(DETECTORS)) -> tuple[str, Counter[str]]:
    """Text with every span replaced by its typed placeholder, and counts per type."""
    spans = find_pii(text, kinds)
    counts: Counter[str] = Counter(s.kind for s in spans)
    out, pos = [], 0
    for s in spans:
        out.append(text[pos : s.start])
        out.append(PLACEHOLDERS[s.kind])
        pos = s.end
    out.append(text[pos:])
    return "".join(out), counts


class PIIRedactor(Step):
    """Replaces PII by typed placeholders; keeps every document; counts replacements."""

    name = "pii"

    def __init__(self, kinds: Iterable[str] = tuple(DETECTORS)):
        super().__init__()
        self.kinds = tuple(kinds)
        for k in self.kinds:
            if k not in DETECTORS:
                raise ValueError(f"PII kind '{k}': use some of {sorted(DETECTORS)}")

    def process(self, doc: Document) -> Document:
        text, counts = redact(doc.text, self.kinds)
        if counts:
            doc.text = text
            self.counters.update({f"replaced_{k}": v for k, v in counts.items()})
            self.counters["documents_changed"] += 1
        return doc

    def describe(self) -> str:
        return f"{self.name}({', '.join(self.kinds)})"
