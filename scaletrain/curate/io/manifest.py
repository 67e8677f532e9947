"""The manifest of a curated output folder: the kept shards, and nothing else.

A curation run (`run_pipeline`) writes `OUTPUT/manifest.json` last, after every kept shard is
in place. It lists those shards (name and document count). Every reader given a curated
folder (`expand_inputs`, hence curation stages and `data inspect`; `data tokenize`) reads the
files it lists, never the dropped documents under `_dropped/`, a crashed run's intermediate
stages under `_work/` or stray files. A folder that holds a run's `_work/` but no manifest is
an unfinished run: reading it is an error that says to finish the run first.
"""

from __future__ import annotations

import json
import os
from typing import Any

from scaletrain.curate.io.errors import InputError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "scaletrain-curated/1"
WORK_DIR = "_work"
STATS = "stats.json"


def write_manifest(out_dir: str, files: list[tuple[str, int]], extra: dict[str, Any]) -> str:
    """Write OUT_DIR/manifest.json (temporary name, then rename) for `(path, documents)`."""
    entries = [{"path": os.path.relpath(p, out_dir), "documents": n} for p, n in files]
    body = {
        "format": MANIFEST_FORMAT,
        "documents": sum(n for _, n in files),
        "files": entries,
        **extra,
    }
    path = os.path.join(out_dir, MANIFEST)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def forget_manifest(out_dir: str) -> None:
    """A run starting in OUT_DIR: the folder is not a finished output until it ends."""
    for name in (MANIFEST, STATS):
        p = os.path.join(out_dir, name)
        if os.path.exists(p):
            os.remove(p)


def curated_files(directory: str) -> list[str] | None:
    """The kept shards of a curated folder, or None when `directory` is not one.

    Raises `InputError` for an unfinished run (a `_work/` folder, no manifest) and for a
    manifest naming a file that is gone.
    """
    mpath = os.path.join(directory, MANIFEST)
    if os.path.isfile(mpath):
        try:
            with open(mpath, encoding="utf-8") as f:
                body = json.load(f)
            names = [e["path"] for e in body["files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"'{mpath}' is damaged ({e}); run the curation again") from None
        files = [os.path.join(directory, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise InputError(
                f"'{mpath}' lists {len(missing)} file(s) that are gone (first: '{missing[0]}'); "
                "run the curation again"
            )
        return files
    if os.path.isdir(os.path.join(directory, WORK_DIR)):
        raise InputError(
            f"'{directory}' is an unfinished curation run (it has {WORK_DIR}/ but no {MANIFEST}); "
            "run the same curate command again to finish it, then read the folder"
        )
    return None
