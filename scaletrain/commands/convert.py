"""`scaletrain convert SRC DST --to hf|native`: Hugging Face safetensors <-> native checkpoints.

SRC may be a Hugging Face directory, a native checkpoint, a training run directory (its
latest checkpoint is used) or a `scaletrain finetune` output (LoRA adapters merged into the
base). A `tokenizer.json` next to the weights is carried across.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from scaletrain.commands._checkpoint_flags import add_trust_flags, trust_settings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse_size(text: str) -> int:
    """'500MB', '2GB', '1000000' -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda u: -len(u[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t.removesuffix("B"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="checkpoint to read (HF dir, native dir or run dir)")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument("--to", required=True, choices=["hf", "native"], help="output format")
    p.add_argument("--dtype", choices=sorted(_DTYPES),
                   help="weight dtype to write (default: HF -> as stored, native -> float32)")
    p.add_argument("--max-shard-size", type=_parse_size, default=None, metavar="SIZE",
                   help="HF output: split weights into shards of at most SIZE (e.g. 2GB)")
    p.add_argument("--step", type=int, default=0, help="native output: step recorded in meta")
    add_trust_flags(p)
    return p


def run(args: argparse.Namespace) -> Path:
    from scaletrain.checkpoint.native_format import META_NAME, read_meta, save_model_checkpoint
    from scaletrain.inference.loader import load_model
    from scaletrain.models.hf import save_hf_checkpoint
    from scaletrain.models.transformer import Transformer

    dst = Path(args.dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new output directory")
    dtype = _DTYPES[args.dtype] if args.dtype else None
    from scaletrain.inference.loader import model_args_of

    if args.to == "hf" and not model_args_of(args.src).is_moe:
        # block by block, adapters merged on the way: never the whole model (MoE checkpoints,
        # whose experts are stacked and adapted per expert, convert whole below)
        from scaletrain.finetune.export import export_hf

        return export_hf(args.src, dst, dtype, args.max_shard_size, _special_tokens)
    # a fine-tune: base + adapter merged, or its trained weights
    finetuned = (Path(args.src) / "finetune.json").is_file()
    loaded = load_model(args.src, dtype=dtype or torch.float32 if finetuned else dtype)
    if not isinstance(loaded.model, Transformer):
        raise ValueError(f"{args.src} is a {(loaded.finetune or {}).get('task')} fine-tune; "
                         "only language models (task sft) convert to a causal-LM checkpoint")
    step = args.step
    if not finetuned and not step and (loaded.directory / META_NAME).is_file():
        step = read_meta(loaded.directory)["step"]
    if args.to == "hf":
        eos = list(loaded.stop_ids) if len(loaded.stop_ids) > 1 else loaded.eos_id
        save_hf_checkpoint(loaded.model, dst, args.max_shard_size, eos_token_id=eos,
                           tokenizer_file=loaded.tokenizer_path,
                           special_tokens=_special_tokens(loaded.tokenizer_path))
    else:
        save_model_checkpoint(loaded.model, loaded.args, dst,
                              tokenizer_file=loaded.tokenizer_path, step=step)
    return dst


def _special_tokens(tokenizer_path: Path | None) -> dict[str, str]:
    """The end- and begin-of-document tokens of a tokenizer.json, as Hugging Face's
    `eos_token` / `bos_token` (the tokens the data path and the loader recognise)."""
    if tokenizer_path is None:
        return {}
    from tokenizers import Tokenizer

    from scaletrain.data.tokenizer import BOS_CANDIDATES, EOS_CANDIDATES

    vocab = Tokenizer.from_file(str(tokenizer_path)).get_vocab(with_added_tokens=True)
    out = {}
    for key, candidates in (("eos_token", EOS_CANDIDATES), ("bos_token", BOS_CANDIDATES)):
        found = next((c for c in candidates if c in vocab), None)
        if found is not None:
            out[key] = found
    return out


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        with trust_settings(args):
            dst = run(args)
    except (OSError, ValueError, KeyError) as e:
        print(f"scaletrain convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.to} checkpoint {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
