"""`scaletrain generate --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3)`: sample a
continuation with the KV cache and print it (or, with --json, one JSON object
{"ids": [new token ids], "text": new text or null}).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from scaletrain.commands._checkpoint_flags import add_trust_flags, trust_settings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 1,2,3 (got {text!r})"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="HF dir, native checkpoint or training run dir (latest checkpoint)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the checkpoint)")
    src.add_argument("--prompt-ids", type=_ids, metavar="IDS", help="prompt token ids, 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 for greedy decoding (default: the model's generation_config.json, "
                        "else 0.8)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k likeliest (default: the model's generation config)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass (default: the model's generation config)")
    p.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    p.add_argument("--no-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="weight dtype (default: as stored for HF, float32 for native)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_trust_flags(p)
    return p


def sampling(args: argparse.Namespace, defaults: dict) -> tuple[float, int | None,
                                                                float | None]:
    """(temperature, top_k, top_p): the flags, else the model's generation settings."""
    temperature = args.temperature
    if temperature is None:
        temperature = 0.0 if defaults.get("do_sample") is False else float(
            defaults.get("temperature", 0.8))
    top_k = args.top_k if args.top_k is not None else defaults.get("top_k")
    top_p = args.top_p if args.top_p is not None else defaults.get("top_p")
    return temperature, (top_k or None), top_p


def run(args: argparse.Namespace) -> dict:
    from scaletrain.inference.generation import generate
    from scaletrain.inference.loader import load_model
    from scaletrain.models.transformer import Transformer

    device = torch.device(args.device)  # a malformed name raises RuntimeError
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    loaded = load_model(args.checkpoint, device=device,
                        dtype=_DTYPES[args.dtype] if args.dtype else None)
    if not isinstance(loaded.model, Transformer):
        raise ValueError(f"{args.checkpoint} is a classification fine-tune, not a language "
                         "model; use `scaletrain predict --checkpoint` with it")
    tokenizer, eos = loaded.tokenizer, loaded.eos_id
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(
                f"{args.checkpoint} has no tokenizer, so --prompt text cannot be encoded; "
                "pass token ids with --prompt-ids 1,2,3 instead"
            )
        prompt_ids = tokenizer.encode(args.prompt).ids
    else:
        prompt_ids = args.prompt_ids
    temperature, top_k, top_p = sampling(args, loaded.generation)
    new_ids = generate(
        loaded.model, prompt_ids, args.max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, eos_id=None if args.no_eos else loaded.stop_ids or eos, seed=args.seed,
    )
    text = tokenizer.decode(new_ids, skip_special_tokens=True) if tokenizer else None
    return {"ids": new_ids, "text": text}


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    try:
        with trust_settings(args):
            result = run(args)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"scaletrain generate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    elif result["text"] is not None:
        print(result["text"])
    else:
        print(",".join(map(str, result["ids"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
