"""C4 rules (Raffel et al. 2020, T5 paper section 2.2) as TensorFlow Datasets' `c4_utils.
clean_page` applies them, with the published settings as defaults.

Per line, in the reference order: a word over 1000 characters drops the line; citation
marks are cut out; a line not ending in . ? ! " (or ending in an ellipsis) is dropped; a line
of fewer than 3 words is dropped; "lorem ipsum" drops the page; "javascript" drops the line;
a curly bracket drops the page; cookie/policy notices drop the line. Only lines that reach a
rule are tested by it, so a `{` in a line dropped earlier (no end mark, say) leaves the page.
The page is dropped with fewer than 5 sentences in its kept lines. Sentences are counted per
kept line as the reference's punkt tokenizer splits English (see `count_sentences`).
"""

from __future__ import annotations

import re

from scaletrain.curate.documents import Document
from scaletrain.curate.pipeline import Step

_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
END_MARKS = (".", "?", "!", '"')
ELLIPSIS = "..."
POLICY_PHRASES = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)
# a candidate sentence end: a word, end marks, closing quotes/brackets, space, more text
_BOUNDARY = re.compile(r"(\S*?)([.!?]+)[\"'\u201d\u2019)\]]*\s+(?=(\S))")
# words a period does not end a sentence after (punkt's English model knows these)
_ABBREV_TEXT = (
    "mr mrs ms dr prof sr jr st mt ft vs etc inc ltd co corp no nos vol vols fig figs approx "
    "dept est gen gov sen rep rev sgt capt col lt jan feb mar apr jun jul aug sep sept oct "
    "nov dec mon tue wed thu fri sat sun e.g i.e u.s u.k a.m p.m cf al"
)
ABBREVIATIONS = frozenset(_ABBREV_TEXT.split())


def count_sentences(line: str) -> int:
    """Sentences in one line, as punkt's English model counts them (approximated): a run
    of . ! ? followed by space ends a sentence, except a period after an abbreviation, an
    initial ("N."), a list number at the start of the line, or before a lower-case word."""
    if not line.strip():
        return 0
    n = 1
    for m in _BOUNDARY.finditer(line):
        word, marks, nxt = m.group(1), m.group(2), m.group(3)
        if nxt.islower():
            continue
        if "!" in marks or "?" in marks or len(marks) > 1:
            n += 1
            continue
        core = word.lstrip("\"'(\u201c\u2018[").lower()
        if (core in ABBREVIATIONS or (len(core) == 1 and core.isalpha())
                or (core.isdigit() and m.start() == 0)):
            continue
        n += 1
    return n


class C4Filter(Step):
    """C4's line and page rules in the reference order (see the module docstring).

    Rewrites `text` with the kept lines; counts removed lines per reason."""

    name = "c4"

    def __init__(
        self,
        min_words_per_line: int = 3,
        max_word_length: int = 1000,
        min_sentences: int = 5,
        remove_citations: bool = True,
        drop_no_terminal_punct: bool = True,
        drop_javascript: bool = True,
        drop_policy: bool = True,
        filter_lorem_ipsum: bool = True,
        filter_curly_bracket: bool = True,
        end_marks: tuple[str, ...] = END_MARKS,
    ):
        super().__init__()
        self.min_words_per_line, self.max_word_length = min_words_per_line, max_word_length
        self.min_sentences, self.remove_citations = min_sentences, remove_citations
        self.drop_no_terminal_punct, self.drop_javascript = drop_no_terminal_punct, drop_javascript
        self.drop_policy, self.filter_lorem_ipsum = drop_policy, filter_lorem_ipsum
        self.filter_curly_bracket = filter_curly_bracket
        self.end_marks = tuple(end_marks)

    def _line(self, line: str) -> tuple[str | None, str | None]:
        """(kept line or None, reason: a line reason, or 'page:REASON' to drop the page)."""
        if self.max_word_length and any(len(w) > self.max_word_length for w in line.split()):
            return None, "line_long_word"
        if self.remove_citations:
            line = _CITATION.sub("", line)
        if self.drop_no_terminal_punct and (
            not line.endswith(self.end_marks) or line.endswith(ELLIPSIS)
        ):
            return None, "line_no_terminal_punct"
        if len(line.split()) < self.min_words_per_line:
            return None, "line_too_few_words"
        low = line.lower()
        if self.filter_lorem_ipsum and "lorem ipsum" in low:
            return None, "page:lorem_ipsum"
        if self.drop_javascript and "javascript" in low:
            return None, "line_javascript"
        if self.filter_curly_bracket and "{" in line:
            return None, "page:curly_bracket"
        if self.drop_policy and any(p in low for p in POLICY_PHRASES):
            return None, "line_policy"
        return line, None

    def process(self, doc: Document) -> Document | str:
        kept: list[str] = []
        sentences = 0
        for raw in doc.text.splitlines():
            line, why = self._line(raw.strip())
            if why is not None and why.startswith("page:"):
                return why[5:]
            if line is None:
                if raw.strip():
                    self.counters[why or ""] += 1
                continue
            sentences += count_sentences(line)
            kept.append(line)
        if sentences < self.min_sentences:
            return "too_few_sentences"
        doc.text = "\n".join(kept).strip()
        return doc

    def describe(self) -> str:
        return (f"{self.name}(>= {self.min_words_per_line} words/line, >= "
                f"{self.min_sentences} sentences, end marks {''.join(self.end_marks)})")
