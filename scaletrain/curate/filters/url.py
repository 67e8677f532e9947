"""URL block lists: blocked domains (and their subdomains) and banned words in the URL."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from scaletrain.curate.documents import Document
from scaletrain.curate.pipeline import Filter


def load_list(path: str | Path) -> list[str]:
    """One entry a line; blank lines and '#' comments ignored."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"URL block list '{p}' not found; give a text file, one entry a line"
        )
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip().lower()
        if line:
            out.append(line)
    return out


class UrlFilter(Filter):
    """Drops documents whose `metadata[url_key]` host is a blocked domain or a subdomain of
    one, or whose URL contains a banned word. Documents without a URL are kept unless
    `drop_missing`."""

    name = "url"

    def __init__(
        self,
        blocked_domains: Iterable[str] = (),
        banned_words: Iterable[str] = (),
        domains_file: str | None = None,
        url_key: str = "url",
        drop_missing: bool = False,
    ):
        super().__init__()
        domains = [d.lower().lstrip(".") for d in blocked_domains]
        if domains_file:
            domains += load_list(domains_file)
        self.blocked = frozenset(domains)
        self.banned_words = tuple(w.lower() for w in banned_words)
        self.url_key, self.drop_missing = url_key, drop_missing

    def reason(self, doc: Document) -> str | None:
        url = doc.metadata.get(self.url_key)
        if not url:
            return "no_url" if self.drop_missing else None
        url = str(url).lower()
        host = (urlsplit(url if "//" in url else "//" + url).hostname or "").rstrip(".")
        parts = host.split(".")
        for i in range(len(parts) - 1):
            if ".".join(parts[i:]) in self.blocked:
                return "blocked_domain"
        if any(w in url for w in self.banned_words):
            return "banned_url_word"
        return None

    def describe(self) -> str:
        return f"{self.name}({len(self.blocked)} domains, {len(self.banned_words)} words)"
