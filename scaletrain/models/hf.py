"""Hugging Face interop: configs and safetensors checkpoints (the state-dict renaming is
`hf_state_dict.py`).

Llama-layout checkpoints (Llama, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 1 and 2; family differences
in `hf_families.py`) map by plain renaming (our RoPE is the HF "rotate half" layout, so q/k need
no permutation); Phi-3's fused projections are split at load and fused again at export.
GPT-2 checkpoints use `Conv1D` weights stored as [in, out] and a fused
`c_attn` (q, k, v) projection, which are transposed and split (`hf_state_dict.py`).

No distributed code and nothing from the rest of the package: this module reads and writes
plain state dicts and files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from scaletrain.models.args import ModelArgs
from scaletrain.models.files import honour_umask, make_output_dir
from scaletrain.models.hf_families import (
    SUPPORTED_MODEL_TYPES,
    rope_family_args,
    rope_family_config,
    unsupported_model_type,
)
from scaletrain.models.hf_files import (
    CONFIG_NAME,
    check_expert_count,
    config_layer_count,
    header_shapes,
    hf_manifest,
    read_hf_weights,
    weight_files,
)
from scaletrain.models.hf_moe import MOE_MODEL_TYPES, moe_args, moe_config, refuse_other_moe
from scaletrain.models.hf_save import PlannedTensor, write_shards
from scaletrain.models.hf_slices import HFSlices
from scaletrain.models.hf_state_dict import _IGNORED_HF_KEYS, from_hf_state_dict, to_hf_state_dict
from scaletrain.models.stored_shapes import (
    ManifestMismatch,
    check_layer_count,
    check_stored_shapes,
)
from scaletrain.models.transformer import Transformer, empty_model

logger = logging.getLogger(__name__)

GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# --- configs ---------------------------------------------------------------------------------
def model_args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """`ModelArgs` for a Hugging Face `config.json` (Llama, Qwen2/2.5, Qwen3, Mistral, Phi-3,
    Gemma, Gemma 2, GPT-2, Mixtral or Qwen3-MoE), or a ValueError saying why the model cannot be
    represented."""
    model_type = cfg.get("model_type")
    if model_type == "gpt2":
        return _gpt2_args(cfg)
    if model_type in MOE_MODEL_TYPES:
        return moe_args(cfg, rope_family_args)
    refuse_other_moe(model_type)
    if cfg.get("model_type") in SUPPORTED_MODEL_TYPES:
        return rope_family_args(cfg)
    raise unsupported_model_type(model_type)


def _gpt2_args(cfg: dict[str, Any]) -> ModelArgs:
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(
            f"GPT-2 activation_function {act!r} is not supported (only the tanh GELU, "
            "'gelu_new')"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            raise ValueError(f"GPT-2 option {flag}=true is not supported")
    if cfg.get("scale_attn_weights") is False:
        raise ValueError("GPT-2 option scale_attn_weights=false is not supported")
    n_inner = cfg.get("n_inner")
    return ModelArgs(
        arch="gpt2",
        dim=int(cfg["n_embd"]),
        n_layers=int(cfg["n_layer"]),
        n_heads=int(cfg["n_head"]),
        vocab_size=int(cfg["vocab_size"]),
        ffn_dim=int(n_inner) if n_inner else None,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_seq_len=int(cfg.get("n_positions", 1024)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def hf_config_from_model_args(
    args: ModelArgs,
    dtype: torch.dtype | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> dict[str, Any]:
    """The `config.json` contents transformers needs to build the model `args` describes."""
    if args.arch == "gpt2":
        cfg: dict[str, Any] = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": args.dim,
            "n_layer": args.n_layers,
            "n_head": args.n_heads,
            "n_inner": args.hidden_dim,
            "n_positions": args.max_seq_len,
            "vocab_size": args.vocab_size,
            "layer_norm_epsilon": args.norm_eps,
            "activation_function": "gelu_new",
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "tie_word_embeddings": args.tie_embeddings,
        }
        if args.kv_heads != args.n_heads:
            raise ValueError("GPT-2 checkpoints cannot hold grouped-query attention")
    elif args.is_moe:
        cfg = moe_config(args, rope_family_config)
    else:
        cfg = rope_family_config(args)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        cfg["torch_dtype"] = name  # transformers < 5
        cfg["dtype"] = name
    # Always written: transformers fills in model-specific defaults for absent ids.
    cfg["bos_token_id"] = bos_token_id
    cfg["eos_token_id"] = eos_token_id
    return cfg


# --- files ---------------------------------------------------------------------------------
def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a HF checkpoint directory, with errors naming the file."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint directory")
    return read_config_file(path)


def read_config_file(path: Path) -> dict[str, Any]:
    """A JSON object from `path` (a config file), with errors naming the file."""
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object (a Hugging Face config.json)")
    return cfg


def _parse_hf_config(cfg: dict[str, Any], directory: Path) -> ModelArgs:
    try:
        return model_args_from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{directory / CONFIG_NAME}: {what}") from None


def hf_model_args(directory: str | os.PathLike) -> ModelArgs:
    """The `ModelArgs` of a HF checkpoint's config.json, checked against the shapes its
    safetensors headers declare before anything is built (`models.stored_shapes`): a config
    whose sizes the weights do not have is refused in milliseconds, one line."""
    directory = Path(directory)
    cfg = read_hf_config(directory)
    try:
        files = weight_files(directory)
    except FileNotFoundError:
        _parse_hf_config(cfg, directory)  # a config we cannot read is named first
        raise
    shapes = header_shapes(files)
    manifest = hf_manifest(directory, cfg, files)
    names = [k for k in shapes if not _IGNORED_HF_KEYS.search(k)]
    try:  # first, before parsing the config (which may loop over its layers)
        n_layers = int(config_layer_count(cfg))
    except (TypeError, ValueError, OverflowError):
        n_layers = None  # model_args_from_hf_config says what is wrong with it
    if n_layers is not None and cfg.get("model_type") in SUPPORTED_MODEL_TYPES:
        check_layer_count(names, n_layers, manifest)
    args = _parse_hf_config(cfg, directory)
    if args.is_moe:
        check_expert_count(names, args.n_experts, manifest)
    meta = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    try:
        ours = from_hf_state_dict(meta, args)
    except KeyError as e:  # a tensor of another model, or a fused one of other sizes
        raise ManifestMismatch(f"{manifest.path}: {manifest.weights} does not hold the model "
                               f"it describes: {e.args[0]}") from None
    check_stored_shapes({k: tuple(v.shape) for k, v in ours.items()}, args, manifest,
                        allow_extra=False)
    return args


def hf_slices(directory: str | os.PathLike, args: ModelArgs) -> HFSlices:
    """A reader of regions of our tensors from HF checkpoint `directory` (`models.hf_slices`),
    through the one converter (`from_hf_state_dict`)."""
    return HFSlices(directory, lambda sd: from_hf_state_dict(sd, args), _IGNORED_HF_KEYS)


def load_hf_checkpoint(
    directory: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[Transformer, ModelArgs]:
    """Load a HF safetensors checkpoint of a supported family (see `SUPPORTED_MODEL_TYPES`)
    into our model.

    `dtype=None` keeps the dtype the weights are stored in. Tensors are read one at a time from
    the memory-mapped files straight into the model (cast on the way), so the peak host memory
    is the model plus one tensor, not two copies of it.
    """
    directory = Path(directory)
    args = hf_model_args(directory)  # names and shapes checked against the stored ones
    try:
        reader = hf_slices(directory, args)
    except KeyError as e:
        raise ValueError(f"{directory}: {e.args[0]}") from None
    with reader:
        if dtype is None:
            dtype = reader.stored_dtype()
        model = empty_model(args, device=device, dtype=dtype)
        targets = model.state_dict()
        missing = sorted(set(targets) - set(reader.shapes))
        if missing:
            raise ValueError(f"{directory}: missing tensor(s): {', '.join(missing[:5])}")
        with torch.no_grad():
            done: set[int] = set()
            for name, target in targets.items():
                if id(target) in done:
                    continue  # a tied head
                done.add(id(target))
                target.copy_(reader.read(name, dtype=target.dtype))
    logger.info("loaded %s checkpoint %s (%s)", args.family, directory, dtype)
    return model, args


def save_hf_checkpoint(
    model: Transformer,
    directory: str | os.PathLike,
    max_shard_bytes: int | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    tokenizer_file: str | os.PathLike | None = None,
    special_tokens: dict[str, str] | None = None,
) -> Path:
    """Write `config.json` and safetensors weights (sharded with an index when over
    `max_shard_bytes`) that `transformers` loads with `from_pretrained`. `tokenizer_file` is
    copied as `tokenizer.json`, with the `TOKENIZER_COMPANIONS` found next to it (the chat
    template lives in `tokenizer_config.json` or `chat_template.jinja`). Where it has no
    `tokenizer_config.json` (a tokenizer scaletrain trained), one is written, with
    `special_tokens_map.json`: a fast tokenizer with `special_tokens` (`eos_token`,
    `bos_token`: their strings) and the model's context as `model_max_length`, so
    `AutoTokenizer.from_pretrained` and lm-evaluation-harness load the folder.

    Written to a temporary directory next to `directory`, then renamed into place, so a crash
    never leaves a complete-looking checkpoint. `directory` must not exist yet.
    """
    args: ModelArgs = model.args
    tensors = {k: v.detach().cpu() for k, v in to_hf_state_dict(model.state_dict(), args).items()}
    planned = [PlannedTensor(k, tuple(v.shape), v.dtype, 0) for k, v in tensors.items()]
    return save_hf_stream(directory, args, model.tok_embeddings.weight.dtype, planned,
                          lambda _: tensors, max_shard_bytes, bos_token_id=bos_token_id,
                          eos_token_id=eos_token_id, tokenizer_file=tokenizer_file,
                          special_tokens=special_tokens)


def save_hf_stream(
    directory: str | os.PathLike,
    args: ModelArgs,
    dtype: torch.dtype,
    planned: list[PlannedTensor],
    produce: Callable[[Hashable], dict[str, torch.Tensor]],
    max_shard_bytes: int | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    tokenizer_file: str | os.PathLike | None = None,
    special_tokens: dict[str, str] | None = None,
) -> Path:
    """`save_hf_checkpoint` for weights made group by group (`models.hf_save.write_shards`):
    `planned` names the HF tensors in file order, `produce(group)` makes a group's. Only one
    shard and one group are in memory at a time."""
    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} already exists; choose a new output directory")
    tmp = make_output_dir(directory)
    try:
        cfg = hf_config_from_model_args(args, dtype, bos_token_id, eos_token_id)
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        if eos_token_id is not None or bos_token_id is not None:
            gen = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
            (tmp / GENERATION_CONFIG_NAME).write_text(json.dumps(gen, indent=2) + "\n")
        files = write_shards(tmp, planned, produce, max_shard_bytes)
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
            # The tokenizer's companions (chat template, special tokens) travel with it.
            for name in TOKENIZER_COMPANIONS:
                companion = Path(tokenizer_file).parent / name
                if companion.is_file():
                    shutil.copyfile(companion, tmp / name)
            if not (tmp / "tokenizer_config.json").is_file():
                _write_tokenizer_config(tmp, special_tokens or {}, args.max_seq_len)
        honour_umask(tmp)  # safetensors writes 0600 files
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved %s checkpoint to %s (%d file(s))", args.family, directory, files)
    return directory


def _write_tokenizer_config(folder: Path, special_tokens: dict[str, str], max_len: int) -> None:
    """`tokenizer_config.json` + `special_tokens_map.json` for a bare `tokenizer.json`."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, **special_tokens}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (folder / "special_tokens_map.json").is_file():
        (folder / "special_tokens_map.json").write_text(
            json.dumps(special_tokens, indent=2) + "\n")


__all__ = [
    "model_args_from_hf_config", "hf_config_from_model_args", "read_hf_config",
    "read_hf_weights", "hf_model_args", "hf_slices", "load_hf_checkpoint",
    "save_hf_checkpoint", "save_hf_stream",
    "SUPPORTED_MODEL_TYPES",
]
