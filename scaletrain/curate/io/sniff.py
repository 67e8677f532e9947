"""What a file holds, from its first bytes: binary content, and JSON lines or one JSON document.

A file's suffix says how to read it, but not always what it is: a `.a` archive or an image in
a source tree is not text, and `package.json` is one JSON document, not JSON lines. These
checks read at most the first `SNIFF_BYTES` of a file.
"""

from __future__ import annotations

import json
import re
from typing import IO

SNIFF_BYTES = 8192
# Leading bytes of common binary formats (archives, images, executables, compiled code).
_MAGIC = (
    b"!<arch>\n",  # ar archives (.a, .deb)
    b"\x7fELF",
    b"\xca\xfe\xba\xbe", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe",  # Mach-O, Java class
    b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*",
    b"PK\x03\x04", b"PK\x05\x06", b"7z\xbc\xaf\x27\x1c", b"Rar!\x1a\x07",
    b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"BZh", b"\xfd7zXZ\x00",  # compressed streams
    b"%PDF-", b"\xd0\xcf\x11\xe0",  # PDF, OLE (old Office)
    b"SQLite format 3\x00", b"\x00asm", b"wOFF", b"wOF2",
)
# Suffixes that are never text, skipped without opening the file.
BINARY_SUFFIXES = frozenset((
    ".a", ".o", ".so", ".dylib", ".dll", ".exe", ".lib", ".obj", ".pyc", ".pyo", ".pyd",
    ".class", ".jar", ".whl", ".egg", ".zip", ".tar", ".tgz", ".bz2", ".xz", ".7z", ".rar",
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".tif", ".tiff", ".webp", ".pdf", ".mp3",
    ".mp4", ".wav", ".ogg", ".avi", ".mov", ".woff", ".woff2", ".ttf", ".otf", ".eot", ".npy",
    ".npz", ".pt", ".pth", ".bin", ".safetensors", ".pkl", ".db", ".sqlite", ".idx",
))


def is_binary(head: bytes) -> bool:
    """True for content that is not text: a NUL byte in the first bytes (git's test) or the
    signature of a known binary format. UTF-16 text has NUL bytes and counts as binary."""
    return b"\x00" in head[:SNIFF_BYTES] or head.startswith(_MAGIC)


# Plain-text suffixes whose files may be prose or code/data (a README, notes, a license, a
# log, a grammar): their kind is decided by their content (`looks_like_prose`). A file
# without a suffix (README, LICENSE, Makefile) is decided the same way.
PROSE_SUFFIXES = frozenset((".txt", ".md", ".markdown", ".rst", ".text", ".adoc", ".org"))
# Lines that start like code in the common languages (or are only a bracket).
_CODE_LINE = re.compile(
    r"\s*(?:def |class |import |from \S+ import |#include|#define|#!|function\b|return\b|"
    r"var |let |const |public |private |static |package |using |fn |pub |func |elif |else:|"
    r"if\s*\(|for\s*\(|while\s*\(|[{}\]);]+\s*$|<\?php|</?[a-zA-Z][\w-]*[ >]|@\w+\(|"
    r"SELECT |CREATE |[\w.\[\]]+\s*[-+*/|&]?=\s*\S)")
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"'\u201d\u2019)\]]?(?=\s|$)")
_CODE_CHARS = "{}[]();=<>\\|$_#"


def prose_candidate(name: str) -> bool:
    """A plain-text file whose kind its content decides: a prose suffix or none."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1].lower()
    for c in (".gz", ".zst"):
        base = base.removesuffix(c)
    return "." not in base.lstrip(".") or any(base.endswith(s) for s in PROSE_SUFFIXES)


def looks_like_prose(text: str) -> bool:
    """True for natural-language text (sentences of words), False for code, data, logs and
    markup: from the first `SNIFF_BYTES` characters, prose has (1) few lines that start like
    code (< 15 %), (2) few code characters (`{}[]();=<>|$_#\\`: < 3 % of characters), (3)
    mostly words of letters (>= 75 % of whitespace-separated tokens, punctuation aside) and
    (4) sentences: an end mark (. ! ?) at least every 60 words. Too little text to tell (< 8
    words) is not prose: such a file keeps the rules of its suffix."""
    sample = text[:SNIFF_BYTES]
    words = sample.split()
    lines = [ln for ln in sample.splitlines() if ln.strip()]
    if len(words) < 8 or not lines:
        return False
    code_lines = sum(bool(_CODE_LINE.match(ln)) for ln in lines)
    if code_lines > 0.15 * len(lines):
        return False
    if sum(sample.count(c) for c in _CODE_CHARS) > 0.03 * len(sample):
        return False
    lettered = sum(w.strip(".,;:!?\"'()[]*_-\u201c\u201d\u2018\u2019").isalpha() for w in words)
    if lettered < 0.75 * len(words):
        return False
    return len(_SENTENCE_END.findall(sample)) * 60 >= len(words)


def binary_suffix(name: str) -> bool:
    lower = name.lower()
    return any(lower.endswith(s) for s in BINARY_SUFFIXES)


def json_kind(f: IO[bytes]) -> str:
    """'jsonl' when the stream's first non-blank line is a whole JSON object (JSON lines),
    'document' when it is not (a pretty-printed file such as package.json, an array, or
    anything else): one JSON document, read as one text file. A single-line file holding one
    object without a "text" field (a one-line package.json) is a document too."""
    first, more = b"", False
    for raw in f:
        if not raw.strip():
            continue
        if not first:
            first = raw
            if len(first) > (16 << 20):
                break
            continue
        more = True
        break
    try:
        record = json.loads(first.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError):
        return "document"
    if not isinstance(record, dict):
        return "document"
    return "jsonl" if more or isinstance(record.get("text"), str) else "document"


__all__ = ["BINARY_SUFFIXES", "PROSE_SUFFIXES", "SNIFF_BYTES", "binary_suffix", "is_binary",
           "json_kind", "looks_like_prose", "prose_candidate"]
