"""The one model loader: any model directory -> model, tokenizer, chat template, generation
settings. Every verb that takes a model (generate, serve, predict, eval, convert, finetune
--base, data synth) loads it here.

Accepted: a Hugging Face directory (`config.json` + safetensors), a native checkpoint
(`meta.json` + DCP files), a training run's output directory with
`checkpoints/step-XXXXXXX/` sub-directories (the latest complete one is used), or a
`scaletrain finetune` output directory (`finetune.json`: its base model + adapter, head or
trained weights, applied by the format `scaletrain.finetune` registers:
`inference.finetuned`). Weights are read by the checkpoint readers below this module
(`models.hf.load_hf_checkpoint`, `checkpoint.native_format.load_model_checkpoint`), which verify
them; this module never reads weight files itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scaletrain.checkpoint.native_format import META_NAME, load_model_checkpoint
from scaletrain.inference.finetuned import FINETUNE_META, finetuned_format
from scaletrain.models.args import ModelArgs
from scaletrain.models.hf import CONFIG_NAME, GENERATION_CONFIG_NAME, load_hf_checkpoint
from scaletrain.models.transformer import Transformer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d+)")
# Special tokens that end a document in common tokenizers, most specific first.
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


def find_checkpoint(path: str | os.PathLike) -> tuple[str, Path]:
    """("hf" | "native", directory) for a checkpoint or a training run directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is a file; give the checkpoint directory that holds it")
    if (path / META_NAME).is_file():
        return "native", path
    if (path / CONFIG_NAME).is_file():
        return "hf", path
    for parent in (path / "checkpoints", path):
        steps = [
            (int(m.group(1)), d) for d in parent.glob("step-*")
            if (m := _STEP_DIR.fullmatch(d.name)) and (d / META_NAME).is_file()
        ] if parent.is_dir() else []
        if steps:
            step, latest = max(steps)
            logger.info("using the latest checkpoint %s (step %d)", latest, step)
            return "native", latest
    raise ValueError(
        f"{path} is not a checkpoint: expected {CONFIG_NAME} (Hugging Face), {META_NAME} "
        "(scaletrain native) or a run directory with checkpoints/step-XXXXXXX/ inside"
    )


def _load_tokenizer(path: Path | None) -> Tokenizer | None:
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type
        raise ValueError(f"{path} is not a valid tokenizers JSON file: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def hf_eos_id(directory: Path) -> int | None:
    """eos id from generation_config.json, else config.json (the first when there are several)."""
    ids = hf_eos_ids(directory)
    return ids[0] if ids else None


def hf_eos_ids(directory: Path) -> list[int]:
    """Every eos id of generation_config.json, else of config.json (transformers stops at any
    of them: instruct models list their end-of-turn tokens there)."""
    for name in (GENERATION_CONFIG_NAME, CONFIG_NAME):
        path = directory / name
        if path.is_file():
            value = _read_json(path).get("eos_token_id")
            ids = [v for v in (value if isinstance(value, list) else [value])
                   if isinstance(v, int)]
            if ids:
                return ids
    return []


def tokenizer_eos_id(tokenizer: Tokenizer | None) -> int | None:
    """Best guess at the end-of-text id of a tokenizer that carries no config, by token name."""
    if tokenizer is None:
        return None
    for name in _EOS_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(directory: Path) -> tuple[str | None, dict[str, str]]:
    """(chat template, special-token strings) from `tokenizer_config.json` (or the separate
    `chat_template.jinja` newer tokenizers write), when present."""
    template, special = None, {}
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{config} is not valid JSON: {e}") from None
        template = data.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(data.get(key))
            if text is not None:
                special[key] = text
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    return (template if isinstance(template, str) else None), special


@dataclass
class LoadedModel:
    """What a model directory holds, ready to use."""

    model: nn.Module
    """A `Transformer`, or a `SequenceClassifier` for a classification fine-tune; eval mode."""
    args: ModelArgs
    directory: Path
    """The checkpoint directory the (base) weights came from."""
    tokenizer: Tokenizer | None
    tokenizer_path: Path | None
    eos_id: int | None
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    """Special-token strings for the chat template (bos_token, eos_token, ...)."""
    generation: dict[str, Any] = field(default_factory=dict)
    """Sampling defaults from `generation_config.json` (temperature, top_p, top_k, ...)."""
    finetune: dict[str, Any] | None = None
    """`finetune.json` of a fine-tuning run, else None."""
    stop_ids: tuple[int, ...] = ()
    """Every id generation stops at: `eos_id` first, then the other eos ids of a Hugging Face
    `generation_config.json` (end-of-turn tokens of Llama-3, Gemma 2, Phi-3 instruct models)."""

    @property
    def pad_id(self) -> int:
        """Id written into padding positions (never attended to nor scored)."""
        return self.eos_id if self.eos_id is not None else 0

    @property
    def labels(self) -> list[str] | None:
        return (self.finetune or {}).get("labels")


_GENERATION_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty",
                    "do_sample")


def read_finetune_meta(output: str | os.PathLike) -> dict[str, Any]:
    """`finetune.json` of a fine-tuning run (base, method, task, labels, ...)."""
    path = Path(output) / FINETUNE_META
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}); is {output} a finished "
                         "`scaletrain finetune` output?") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("base"), str):
        raise ValueError(f"{path} names no base model")
    return meta


def load_model(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    merge: bool = True,
    weights: bool = True,
) -> LoadedModel:
    """Load any model directory (see the module docstring).

    `dtype=None` keeps a HF checkpoint's stored dtype and loads native checkpoints in float32.
    A fine-tuning run loads its base in float32, applies the adapter (merged into the weights
    when `merge`), head or trained weights, then casts to `dtype`.
    `weights=False` (a checkpoint, not a fine-tune): everything but the weights; the model is
    built on the meta device (a sharded load fills it later: `checkpoint.sharded_load`).
    """
    if (Path(path) / FINETUNE_META).is_file():
        if not weights:
            raise ValueError(f"{path} is a fine-tuning output; give its base checkpoint")
        return _load_finetuned(Path(path), device, dtype, merge)
    kind, directory = find_checkpoint(path)
    if not weights:
        model, args, tok_path = _skeleton(kind, directory, dtype or torch.float32)
    elif kind == "hf":
        model, args = load_hf_checkpoint(directory, device=device, dtype=dtype)
        tok_path: Path | None = directory / "tokenizer.json"
    else:
        model, args, tok_path = load_model_checkpoint(directory, device=device,
                                                      dtype=dtype or torch.float32)
    if tok_path is not None and not tok_path.is_file():
        tok_path = None
    tokenizer = _load_tokenizer(tok_path)
    template, special = read_chat_template(directory)
    # eos: the model config's, else the tokenizer config's eos_token, else a well-known name
    eos = hf_eos_id(directory) if kind == "hf" else None
    if eos is None and tokenizer is not None and special.get("eos_token"):
        eos = tokenizer.token_to_id(special["eos_token"])
    if eos is None:
        eos = tokenizer_eos_id(tokenizer)
    if eos is not None and not 0 <= eos < args.vocab_size:
        logger.warning("ignoring eos id %d outside the vocabulary (%d)", eos, args.vocab_size)
        eos = None
    gen_cfg = _read_json(directory / GENERATION_CONFIG_NAME) if kind == "hf" else {}
    stops = [] if eos is None else [eos]
    for extra in hf_eos_ids(directory) if kind == "hf" else []:
        if extra not in stops and 0 <= extra < args.vocab_size:
            stops.append(extra)
    model.eval()
    return LoadedModel(model, args, directory, tokenizer, tok_path, eos, template, special,
                       {k: gen_cfg[k] for k in _GENERATION_KEYS if k in gen_cfg},
                       stop_ids=tuple(stops))


def _skeleton(kind: str, directory: Path, dtype: torch.dtype
              ) -> tuple[Transformer, ModelArgs, Path | None]:
    """(model on the meta device, args checked against the stored shapes, tokenizer path)."""
    from scaletrain.checkpoint.native_format import checked_model_args, open_checkpoint
    from scaletrain.models.hf import hf_model_args

    if kind == "hf":
        args, tok_path = hf_model_args(directory), directory / "tokenizer.json"
    else:
        meta = open_checkpoint(directory)
        args = checked_model_args(directory, meta)
        tok_path = directory / meta["tokenizer"] if meta.get("tokenizer") else None
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    return model, args, tok_path


def _load_finetuned(output: Path, device: torch.device | str, dtype: torch.dtype | None,
                    merge: bool) -> LoadedModel:
    """Base + what the run added (see `inference.finetuned`): adapter (LoRA/QLoRA: on the
    full-precision base, merged when `merge`), head (classification) or the latest checkpoint's
    weights (full/freeze)."""
    fmt = finetuned_format()
    meta = read_finetune_meta(output)
    try:
        base = load_model(fmt.base_of(meta), device, torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"{output}: its base model {fmt.base_of(meta)}: {e}") from None
    fmt.check_base(meta, base.directory, output / FINETUNE_META)
    backbone = base.model
    model = fmt.apply(output, meta, backbone, merge)
    if dtype is not None:
        model.to(dtype)
        backbone.reset_buffers()
    model.eval()
    logger.info("loaded %s %s fine-tune from %s (base %s)", meta.get("method"),
                meta.get("task"), output, meta["base"])
    base.model, base.finetune = model, meta
    return base


def model_args_of(path: str | os.PathLike) -> ModelArgs:
    """The dimensions of any model directory `load_model` reads, without reading weights (a
    fine-tune gives its base's), checked against the stored tensor shapes: what
    `finetune --dry-run` plans with."""
    from scaletrain.checkpoint.native_format import checked_model_args, read_meta
    from scaletrain.models.hf import hf_model_args

    if (Path(path) / FINETUNE_META).is_file():
        return model_args_of(finetuned_format().base_of(read_finetune_meta(path)))
    kind, directory = find_checkpoint(path)
    if kind == "hf":
        return hf_model_args(directory)
    return checked_model_args(directory, read_meta(directory))


def load_for_inference(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[Transformer, ModelArgs, Tokenizer | None, int | None]:
    """(language model in eval mode, args, tokenizer or None, eos id or None)."""
    loaded = load_model(path, device, dtype)
    if not isinstance(loaded.model, Transformer):
        raise ValueError(f"{path} is a {(loaded.finetune or {}).get('task')} fine-tune, not a "
                         "language model; use `scaletrain predict --checkpoint` with it")
    return loaded.model, loaded.args, loaded.tokenizer, loaded.eos_id


__all__ = ["LoadedModel", "load_model", "load_for_inference", "find_checkpoint",
           "read_chat_template", "read_finetune_meta", "hf_eos_id", "hf_eos_ids",
           "tokenizer_eos_id", "model_args_of"]
