"""The end-of-training sample starts from a line that opens something to continue."""

from __future__ import annotations

from types import SimpleNamespace

from scaletrain.train.sample import choose_prompt


class CharTokenizer:
    """One token per character."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[ord(c) for c in text])


def _prompt(text: str) -> str:
    tok = CharTokenizer()
    return tok.decode(choose_prompt([ord(c) for c in text], tok))


def test_code_prompt_is_a_definition_line() -> None:
    text = "rn x\n\n\n    y = 1\n    def helper(a, b):\n        return a\n"
    assert _prompt(text) == "def helper(a, b):\n"


def test_prose_prompt_is_the_first_full_line() -> None:
    assert _prompt("ing of a word\n\nThe cat sat on the mat.\nMore.") == \
        "The cat sat on the mat.\n"


def test_a_text_without_lines_falls_back_to_its_start() -> None:
    assert _prompt("no newline at all in this text") == "no newline at all in this text"[:24]
