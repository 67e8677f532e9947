"""Small bases and task data for fine-tuning tests: a tiny Llama pretrained for a few dozen steps
on template sentences, and separable sentiment / instruction data built from the same words."""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the movie", "the film", "this book", "the show", "the meal", "the hotel",
            "the concert", "the game", "this phone", "the service"]
POSITIVE = ["great", "wonderful", "excellent", "lovely", "fantastic", "delightful", "superb"]
NEGATIVE = ["terrible", "awful", "horrible", "dreadful", "boring", "disappointing", "poor"]
NEUTRAL = ["on tuesday", "in march", "last year", "in the city", "at noon", "on the list",
           "in paris"]
COLORS = ["red", "green", "blue", "yellow", "black", "white"]


def sentiment_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Clearly separable texts labelled positive / negative / neutral by their key word."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = ("positive", "negative", "neutral")[i % 3]
        subject = rng.choice(SUBJECTS)
        if label == "positive":
            text = f"{subject} was {rng.choice(POSITIVE)} and i would go again"
        elif label == "negative":
            text = f"{subject} was {rng.choice(NEGATIVE)} and i would not go again"
        else:
            text = f"{subject} was shown {rng.choice(NEUTRAL)} to the public"
        out.append({"text": text, "label": label})
    return out


def qa_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompt/response pairs with a learnable rule: name the color that was mentioned."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        color = rng.choice(COLORS)
        out.append({"prompt": f"{rng.choice(SUBJECTS)} is {color}. what color is it? ",
                    "response": f"it is {color}."})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def corpus_dir(path: Path, n_docs: int = 60, seed: int = 0) -> Path:
    """Text files for pretraining: the task sentences without labels."""
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for d in range(n_docs):
        lines = [r["text"] for r in sentiment_records(20, seed + d)]
        lines += [r["prompt"] + r["response"] for r in qa_records(10, seed + d)]
        rng.shuffle(lines)
        (path / f"doc{d:03d}.txt").write_text("\n".join(lines) + "\n")
    return path


def word_tokenizer(path: Path) -> None:
    """A word-level tokenizer (< 128 ids, the tiny models' vocabulary) for the QA task."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for s in SUBJECTS for w in s.split()} | {
        "is", "what", "color", "it", "?", ".", "red", "green", "blue", "yellow", "black",
        "white"})
    vocab = {"<unk>": 0, "<|endoftext|>": 1} | {w: i + 2 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    tok.save(str(path))
