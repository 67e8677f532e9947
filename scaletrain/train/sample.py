"""The end-of-training sample: a short continuation that shows what the model learned.

Greedy decoding of a small model trained for minutes repeats its most frequent token (on the
demo's Python corpus: newlines, so the sample printed as blank lines). The sample instead starts
from a line that opens something to continue (a `def`/`class` line in code, else the first
non-empty line of the validation text) and draws tokens at temperature 0.8 from the 40 most
likely, seeded by the run's seed so the same run prints the same sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from scaletrain.inference.generation import generate
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model

TEMPERATURE = 0.8
TOP_K = 40
MAX_PROMPT_TOKENS = 32
OPENERS = ("def ", "class ", "async def ")


def choose_prompt(val_tokens: Sequence[int], tokenizer: object) -> list[int]:
    """Token ids of the prompt, taken from the start of the validation text."""
    head = [int(t) for t in val_tokens[:4096]]
    text = tokenizer.decode(head)  # type: ignore[attr-defined]
    lines = text.splitlines(keepends=True)[1:]  # the first may start mid-line
    line = next((x for x in lines if x.lstrip().startswith(OPENERS)), None)
    if line is None:
        line = next((x for x in lines if x.strip()), None)
    if line is None:
        return head[:24]
    ids = tokenizer.encode(line.lstrip()).ids  # type: ignore[attr-defined]
    return ids[:MAX_PROMPT_TOKENS] or head[:24]


def sample_text(args: ModelArgs, state_dict: dict[str, torch.Tensor], device: torch.device,
                val_tokens: Sequence[int], tokenizer_path: str | Path, eos_id: int | None,
                max_new_tokens: int, seed: int) -> str:
    """`prompt█continuation`, decoded, from a plain copy of the trained weights."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    model = build_model(args, device)  # no activation-checkpoint/compile wrappers
    model.load_state_dict(state_dict)
    model.eval()
    prompt = choose_prompt(val_tokens, tokenizer)
    new = generate(model, prompt, max_new_tokens, temperature=TEMPERATURE, top_k=TOP_K,
                   eos_id=eos_id, seed=seed)
    return tokenizer.decode(prompt) + "\u2588" + tokenizer.decode(new)
