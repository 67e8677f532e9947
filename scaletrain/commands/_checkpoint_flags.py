"""The checkpoint-trust flags every verb that loads a model shares."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator


def add_trust_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check checkpoint files against their manifest's content "
                             "hashes (huge checkpoints on trusted storage only)")
    parser.add_argument("--allow-base-mismatch", action="store_true",
                        help="apply a fine-tuned adapter even when its base checkpoint is not "
                             "the one it was trained on")


@contextlib.contextmanager
def trust_settings(args: argparse.Namespace) -> Iterator[None]:
    """The flags of `add_trust_flags` in force for the loads inside the block."""
    from scaletrain.finetune.base_pin import base_mismatch_allowed
    from scaletrain.train.integrity import verification

    with verification(False if args.no_verify else None), \
            base_mismatch_allowed(args.allow_base_mismatch):
        yield
