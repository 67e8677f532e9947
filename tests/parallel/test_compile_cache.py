"""Inductor's on-disk cache directory of a compiled distributed run: one per rank and set of
process-group names (`parallel.compile.isolate_compile_cache`, pytorch/pytorch#176532)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from scaletrain.parallel import compile as compile_mod


def test_cache_directory_follows_rank_and_group_names(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_mod, "_CACHE_BASE", None)
    rank = [0]
    monkeypatch.setattr(compile_mod.dist, "get_rank", lambda: rank[0])

    def groups(*names: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(group_name=n) for n in names]

    first = compile_mod.isolate_compile_cache(groups("20", "3"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(first)
    assert first.parent == tmp_path / "scaletrain"  # under the directory the user chose
    assert compile_mod.isolate_compile_cache(groups("3", "20", "3")) == first  # same groups
    assert compile_mod.isolate_compile_cache(groups("21", "3")) != first  # renumbered groups
    rank[0] = 1
    assert compile_mod.isolate_compile_cache(groups("20", "3")) != first  # another rank
    # The base is the directory the process started with, not the last one set.
    assert compile_mod.isolate_compile_cache(groups("20", "3")).parent == tmp_path / "scaletrain"
