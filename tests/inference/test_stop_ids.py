"""Every end-of-sequence id of a Hugging Face model stops generation, as in transformers.

Instruct models list several in `generation_config.json` (Llama-3: <|end_of_text|>,
<|eom_id|>, <|eot_id|>; Gemma 2: <eos>, <end_of_turn>; Phi-3: <|endoftext|>, <|end|>, ...):
the turn ends at the second or third one, not at the first.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.commands import convert as convert_cmd  # noqa: E402
from scaletrain.commands import generate as generate_cmd  # noqa: E402
from scaletrain.inference.generators import LocalGenerator, SamplingParams  # noqa: E402
from scaletrain.inference.loader import load_model  # noqa: E402
from tests.helpers.family import hf_model, tokens  # noqa: E402


def test_generation_stops_at_every_eos_id_of_generation_config(tmp_path):
    hf = hf_model("gemma2")
    prompt = tokens(12, 1)[0].tolist()
    free = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                       max_new_tokens=20, do_sample=False, pad_token_id=0,
                       eos_token_id=None)[0, len(prompt):].tolist()
    eos = min(set(range(128)) - set(free))  # never generated: only the second id can stop
    turn_end = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    expected = free[: free.index(turn_end) + 1]
    hf.generation_config.eos_token_id = [eos, turn_end]  # "<eos>", "<end_of_turn>"
    hf.generation_config.pad_token_id = 0
    hf.save_pretrained(tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    out = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert out == expected  # transformers stops at the second id

    loaded = load_model(tmp_path / "hf")
    assert loaded.eos_id == eos and loaded.stop_ids == (eos, turn_end)
    args = generate_cmd.build_parser().parse_args(
        ["--checkpoint", str(tmp_path / "hf"), "--prompt-ids", ",".join(map(str, prompt)),
         "--max-new-tokens", "20", "--temperature", "0"])
    assert generate_cmd.run(args)["ids"] == expected
    gen = LocalGenerator(loaded.model, None, loaded.eos_id, stop_ids=loaded.stop_ids)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    assert gen.complete_ids([prompt], params) == [expected]

    assert convert_cmd.main([str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "hf"]) == 0
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [eos, turn_end]
