"""Heuristic document filters, each with its published default thresholds."""

from scaletrain.data.filters.c4 import C4Filter
from scaletrain.data.filters.counts import CodeFilter, CountsFilter
from scaletrain.data.filters.fineweb import FineWebQualityFilter
from scaletrain.data.filters.gopher import GopherQualityFilter, GopherRepetitionFilter
from scaletrain.data.filters.language import LanguageFilter
from scaletrain.data.filters.url import UrlFilter

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
