"""Heuristic document filters, each with its published default thresholds."""

from scaletrain.curate.filters.c4 import C4Filter
from scaletrain.curate.filters.counts import CodeFilter, CountsFilter
from scaletrain.curate.filters.fineweb import FineWebQualityFilter
from scaletrain.curate.filters.gopher import GopherQualityFilter, GopherRepetitionFilter
from scaletrain.curate.filters.language import LanguageFilter
from scaletrain.curate.filters.url import UrlFilter

__all__ = [
    "C4Filter",
    "CodeFilter",
    "CountsFilter",
    "FineWebQualityFilter",
    "GopherQualityFilter",
    "GopherRepetitionFilter",
    "LanguageFilter",
    "UrlFilter",
]
