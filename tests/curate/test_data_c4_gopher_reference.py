"""C4 and Gopher rules as their reference code applies them (TensorFlow Datasets' c4_utils,
the Gopher paper and datatrove): the cases where we used to differ."""

from __future__ import annotations

import pytest

from scaletrain.curate.documents import Document
from scaletrain.curate.filters.c4 import C4Filter, count_sentences
from scaletrain.curate.filters.gopher import GopherRepetitionFilter
from scaletrain.curate.filters.text import WordNgrams, duplicate_ngram_char_fraction

SENTENCES = [
    "The river flooded the valley in the spring of that year.",
    "Farmers moved their animals to the hills for several weeks.",
    "The water left rich soil behind when it went down again.",
    "Crops grew well in the following summer, better than before.",
    "Historians still write about the flood and the harvest after it.",
]


def _c4(text: str) -> Document | str:
    return C4Filter().process(Document("x", text))


def test_c4_drops_lines_ending_in_an_ellipsis() -> None:
    res = _c4("\n".join([*SENTENCES, "Read more about the flood and the harvest..."]))
    assert isinstance(res, Document) and res.text.splitlines() == SENTENCES
    # the reference's end marks are . ? ! " only
    res = _c4("\n".join([*SENTENCES, "He called it 'the year of the river'"]))
    assert isinstance(res, Document) and res.text.splitlines() == SENTENCES


def test_c4_initials_and_list_numbers_do_not_end_sentences() -> None:
    assert count_sentences("John N. Smith wrote the report in May.") == 1
    assert count_sentences("3. Add the salt and stir well.") == 1
    assert count_sentences("Mr. Brown met Dr. Green at the U.S. embassy.") == 1
    assert count_sentences("It rained. Then it stopped! Why? Nobody knows.") == 4
    # four lines of one sentence each: below C4's five sentences, whatever the initials
    lines = ["Report by John N. Smith and Mary K. Jones on the flood.", *SENTENCES[:3]]
    assert _c4("\n".join(lines)) == "too_few_sentences"
    assert isinstance(_c4("\n".join([*lines, SENTENCES[3]])), Document)


def test_c4_curly_bracket_only_in_lines_that_reach_the_rule() -> None:
    # the reference drops this line for its missing end mark before it looks for "{"
    res = _c4("\n".join(["var x = {a: 1}", *SENTENCES]))
    assert isinstance(res, Document) and res.text.splitlines() == SENTENCES
    assert _c4("\n".join(["Set the value to {a: 1} in the file.", *SENTENCES])) == \
        "curly_bracket"
    # same for lorem ipsum: only in a kept-so-far line
    res = _c4("\n".join(["Lorem ipsum", *SENTENCES]))
    assert isinstance(res, Document)
    assert _c4("\n".join(["Lorem ipsum dolor sit amet.", *SENTENCES])) == "lorem_ipsum"


def test_c4_long_word_is_checked_before_citations_are_cut() -> None:
    long_cite = "Word " + "[" + "1" * 1000 + "]" + " ends here."
    res = _c4("\n".join([long_cite, *SENTENCES]))
    assert isinstance(res, Document) and res.text.splitlines() == SENTENCES


def test_duplicate_ngrams_count_repeats_not_first_occurrences() -> None:
    ws = ("a b c d e " + " ".join("fghijklmno") + " a b c d e").split()
    # the second "a b c d e" is the only repeat: 5 one-letter words of 20
    assert duplicate_ngram_char_fraction(ws, 5) == pytest.approx(5 / 20)
    assert WordNgrams(ws).duplicate_fraction(5) == pytest.approx(5 / 20)


def test_a_real_press_release_repeating_a_name_is_kept() -> None:
    """A CCNet page naming "City Dogs Rescue & City Kitties" six times: 5-gram repeats
    are 0.14 of its characters (0.196 when first occurrences were counted too)."""
    from scaletrain.curate.io.readers import read_documents
    from tests.helpers.curate import fixture_dir

    docs = read_documents(str(fixture_dir() / "ccnet_en_head-0091.jsonl.gz"))
    page = next(d for d in docs if "City Dogs Rescue & City Kitties" in d.text)
    f = GopherRepetitionFilter()
    assert WordNgrams(page.text.split()).duplicate_fraction(5) < 0.15
    assert f.reason(page) is None
    spam = page.text + " " + " ".join(["buy cheap shoes online today at our store"] * 12)
    assert f.reason(Document("y", spam)) is not None


def test_gopher_symbol_ratio_is_per_symbol() -> None:
    """The paper: a symbol-to-word ratio over 0.1 "for either the hash symbol or the
    ellipsis", so 8 % hashes and 8 % ellipses together pass."""
    from scaletrain.curate.filters.gopher import GopherQualityFilter

    base = " ".join(SENTENCES * 2).split()  # 104 words with stop words
    text = " ".join(base[:100]) + " #a" * 8 + " wait... then" * 8 + " the end."
    assert GopherQualityFilter().reason(Document("x", text)) is None
    assert GopherQualityFilter().reason(Document("x", text + " #b" * 8)) == "symbol_word_ratio"
