"""The checkpoint-trust flags every verb that loads a model shares."""

from __future__ import annotations

import argparse
import contextlib
import os
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
    """The flags of `add_trust_flags` in force for the loads inside the block, in this thread
    and (through the environment) in the worker threads and processes the verb starts."""
    from scaletrain.checkpoint.integrity import VERIFY_ENV, verification
    from scaletrain.finetune.base_pin import ALLOW_ENV, base_mismatch_allowed

    env = {VERIFY_ENV: "0" if args.no_verify else None,
           ALLOW_ENV: "1" if args.allow_base_mismatch else None}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    try:
        with verification(False if args.no_verify else None), \
                base_mismatch_allowed(True if args.allow_base_mismatch else None):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
