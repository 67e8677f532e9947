"""`scaletrain predict --checkpoint OUTPUT (--text TEXT ... | --input FILE.jsonl) [--json]`:
run a `scaletrain finetune` result on new inputs.

Classification: the predicted label of each text (with --json, also every label's probability).
SFT: the model's response to each prompt (formatted with the chat template when the base has
one). `--input` reads JSON lines with a "text" (or "prompt") field.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

import torch

from scaletrain.commands._checkpoint_flags import add_trust_flags, trust_settings

if TYPE_CHECKING:
    from scaletrain.finetune.loading import Finetuned


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain predict", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="output directory of `scaletrain finetune`")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", action="append", help="an input text (repeatable)")
    src.add_argument("--input", metavar="FILE", help="JSON lines with a 'text' or 'prompt' field")
    p.add_argument("--batch-size", type=int, default=16, help="classification texts per batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="SFT: response length cap")
    p.add_argument("--temperature", type=float, default=0.0, help="SFT: 0 for greedy decoding")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object per input")
    add_trust_flags(p)
    return p


def _inputs(args: argparse.Namespace) -> list[str]:
    if args.text:
        return list(args.text)
    from scaletrain.finetune.data import read_jsonl

    texts = []
    for where, rec in read_jsonl(args.input):
        text = rec.get("text", rec.get("prompt"))
        if not isinstance(text, str):
            raise ValueError(f"{where}: expected a string 'text' (or 'prompt') field")
        texts.append(text)
    return texts


@torch.no_grad()
def classify(done: Finetuned, texts: list[str], batch_size: int,
             device: torch.device) -> list[dict]:
    from scaletrain.finetune.data import encode_text, pad_batch

    seq_len = int(done.meta["seq_len"])
    out = []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        ids = [encode_text(done.base, t, seq_len, f"input {start + i + 1}")
               for i, t in enumerate(chunk)]
        batch = pad_batch(ids, max(len(i) for i in ids), done.base.pad_id)
        logits = done.model(batch["tokens"].to(device), batch["lengths"].to(device))
        probs = logits.float().softmax(-1).cpu()
        for text, p in zip(chunk, probs):
            out.append({"text": text, "label": done.labels[int(p.argmax())],
                        "probs": {name: round(float(v), 6) for name, v in zip(done.labels, p)}})
    return out


def respond(done: Finetuned, texts: list[str], args: argparse.Namespace) -> list[dict]:
    from scaletrain.inference.chat import ChatFormatter
    from scaletrain.inference.generation import generate

    base = done.base
    formatter = ChatFormatter(base.tokenizer, base.eos_id, base.chat_template,
                              base.special_tokens)
    out = []
    for text in texts:
        new = generate(done.model, formatter.prompt_ids(text), args.max_new_tokens,
                       temperature=args.temperature, eos_id=base.stop_ids or base.eos_id,
                       seed=0)
        out.append({"prompt": text, "response": base.tokenizer.decode(new,
                                                                      skip_special_tokens=True)})
    return out


def run(args: argparse.Namespace) -> list[dict]:
    from scaletrain.finetune.loading import is_finetune_output, load_finetuned

    if not is_finetune_output(args.checkpoint):
        raise ValueError(f"{args.checkpoint} is not a `scaletrain finetune` output (no "
                         "finetune.json); for a plain language model use `scaletrain generate`")
    device = torch.device(args.device)
    done = load_finetuned(args.checkpoint, device=device)
    texts = _inputs(args)
    if done.meta["task"] == "classification":
        return classify(done, texts, args.batch_size, device)
    return respond(done, texts, args)


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        with trust_settings(args):
            results = run(args)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"scaletrain predict: error: {e}", file=sys.stderr)
        return 2
    for r in results:
        if args.json:
            print(json.dumps(r))
        elif "label" in r:
            print(f"{r['label']}\t{r['text']}")
        else:
            print(r["response"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
