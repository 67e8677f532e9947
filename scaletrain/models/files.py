"""Output directories written whole or not at all, with the permissions the umask asks for.

`tempfile.mkdtemp` creates 0700 directories and some writers (safetensors) create 0600 files;
a checkpoint written for others to read must get the user's usual permissions instead.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def current_umask() -> int:
    """The process umask (read from /proc where possible: setting it is not thread-safe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_output_dir(final: str | os.PathLike) -> Path:
    """A fresh temporary directory beside `final` (rename it to `final` when complete)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()  # honours the umask, unlike mkdtemp
    return tmp


def honour_umask(directory: str | os.PathLike) -> None:
    """chmod `directory` and everything under it to 0777/0666 minus the umask."""
    mask = current_umask()
    root = Path(directory)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


__all__ = ["current_umask", "make_output_dir", "honour_umask"]
