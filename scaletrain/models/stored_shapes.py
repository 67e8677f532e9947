"""A model manifest (native `meta.json`'s `model_args`, a Hugging Face `config.json`) checked
against the shapes of the tensors stored beside it, before any model is built.

A damaged or hostile manifest must not decide how much memory and time a load takes: a
`n_layers` of 10^7 would build ten million blocks for hours, a `vocab_size` of 10^12 would ask
the allocator for terabytes. The checks here read only names and shapes (DCP `.metadata`,
safetensors headers) and compare them with what the manifest implies, in this order, so that
no step costs more than the tensors actually stored:

1. the number of layers = the distinct layer indices stored (0 .. n-1);
2. the vocabulary and hidden sizes (and GPT-2's positions, MoE's expert count) = the stored
   embedding's (experts') shape;
3. every stored tensor's shape = the shape the manifest implies, taken from a model with ONE
   layer built on the meta device (layers are alike), and no tensor of the model missing.

A mismatch is one `ManifestMismatch` line naming the manifest file, the field, its value and
what the tensors say.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import Transformer

Shape = tuple[int, ...]

# A layer index in our names (`layers.3.`) and in Hugging Face ones (`model.layers.3.`,
# `transformer.h.3.`, `h.3.` of GPT2Model checkpoints).
_LAYER = re.compile(r"^(?:model\.|transformer\.)?(?:layers|h)\.(\d+)\.")
_PREFIX = "layers.0."
# Which manifest field sets the first dimension of a layer tensor (named in mismatch lines).
_SIZE_FIELD = {"feed_forward.w1.weight": "ffn_dim", "feed_forward.w3.weight": "ffn_dim",
               "feed_forward.experts.w1": "moe_ffn_dim", "feed_forward.experts.w3": "moe_ffn_dim"}


class ManifestMismatch(ValueError):
    """The manifest's sizes disagree with the stored tensors; one line naming both."""


@dataclass(frozen=True)
class Manifest:
    """The file whose sizes are checked and how it spells the `ModelArgs` fields."""

    path: Path
    """meta.json or config.json: named first in every message."""
    weights: str
    """What holds the tensors, as messages name it (e.g. `.metadata`, `model.safetensors`)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """`ModelArgs` field -> the manifest's key (`n_layers` -> `num_hidden_layers`)."""

    def label(self, name: str) -> str:
        return self.labels.get(name, name)

    def refuse(self, name: str, value: object, found: str) -> ManifestMismatch:
        return ManifestMismatch(
            f"{self.path}: {self.label(name)} is {value} but {self.weights} {found}: the "
            f"manifest does not describe these weights; restore {self.path.name} from a good "
            "copy of the checkpoint")


def layer_indices(names: Iterable[str]) -> set[int]:
    """The distinct layer indices among tensor names (ours or Hugging Face's)."""
    return {int(m.group(1)) for name in names if (m := _LAYER.match(name))}


def _describe(indices: set[int]) -> str:
    if not indices:
        return "holds no layer tensors"
    ordered = sorted(indices)
    if ordered == [0]:
        return "holds 1 layer (0)"
    if ordered == list(range(len(ordered))):
        return f"holds {len(ordered)} layers (0-{ordered[-1]})"
    shown = ", ".join(map(str, ordered[:6])) + (" ..." if len(ordered) > 6 else "")
    return f"holds {len(ordered)} layers numbered {shown}"


def check_layer_count(names: Iterable[str], n_layers: int, manifest: Manifest) -> None:
    """Refuse a layer count other than the stored layers 0 .. n-1 (costs the stored names)."""
    found = layer_indices(names)
    if len(found) != n_layers or (found and max(found) != n_layers - 1):
        raise manifest.refuse("n_layers", n_layers, _describe(found))


def _check_named_sizes(stored: Mapping[str, Shape], args: ModelArgs, manifest: Manifest) -> None:
    """Vocabulary, hidden size, GPT-2 positions and the expert count against the stored
    embedding (expert) shapes, before a model with those sizes is even described."""
    emb = stored.get("tok_embeddings.weight")
    if emb is not None and len(emb) == 2:
        if emb[0] != args.vocab_size:
            raise manifest.refuse("vocab_size", args.vocab_size,
                                  f"stores the embedding with {emb[0]} rows {list(emb)}")
        if emb[1] != args.dim:
            raise manifest.refuse("dim", args.dim,
                                  f"stores the embedding with width {emb[1]} {list(emb)}")
    pos = stored.get("pos_embeddings.weight")
    if pos is not None and args.arch == "gpt2" and len(pos) == 2 and pos[0] != args.max_seq_len:
        raise manifest.refuse("max_seq_len", args.max_seq_len,
                              f"stores {pos[0]} position embeddings {list(pos)}")
    if args.is_moe:
        for name, shape in stored.items():
            if name.endswith("feed_forward.experts.w1") and shape and shape[0] != args.n_experts:
                raise manifest.refuse("n_experts", args.n_experts,
                                      f"stores {shape[0]} experts in {name} {list(shape)}")


def expected_shapes(args: ModelArgs) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """(shapes of the tensors outside the layers, shapes of one layer's tensors by their name
    inside the layer), from a one-layer model on the meta device: no memory, any sizes."""
    with torch.device("meta"):
        model = Transformer(args.replace(n_layers=1))
    top: dict[str, Shape] = {}
    layer: dict[str, Shape] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(_PREFIX):
            layer[name.removeprefix(_PREFIX)] = tuple(tensor.shape)
        else:
            top[name] = tuple(tensor.shape)
    return top, layer


def _expected(name: str, top: Mapping[str, Shape], layer: Mapping[str, Shape]) -> Shape | None:
    m = _LAYER.match(name)
    if m is None:
        return top.get(name)
    return layer.get(name[m.end():])


def check_stored_shapes(stored: Mapping[str, Shape], args: ModelArgs, manifest: Manifest,
                        allow_extra: bool = True) -> None:
    """Every check of the module docstring on `stored` (our tensor names -> shapes). Tensors
    the model does not have are refused unless `allow_extra` (DCP loads only what it is asked
    for)."""
    check_layer_count(stored, args.n_layers, manifest)
    _check_named_sizes(stored, args, manifest)
    top, layer = expected_shapes(args)
    extra = []
    for name, shape in stored.items():
        want = _expected(name, top, layer)
        if want is None:
            extra.append(name)
        elif tuple(shape) != want:
            m = _LAYER.match(name)
            size_field = _SIZE_FIELD.get(name[m.end():]) if m else None
            if (size_field is not None and len(shape) == len(want) >= 2
                    and shape[-2] != want[-2]):
                value = args.expert_hidden_dim if "experts" in name else args.hidden_dim
                raise manifest.refuse(size_field, value, f"stores {name} as {list(shape)} "
                                      f"(the manifest's sizes give {list(want)})")
            raise ManifestMismatch(
                f"{manifest.path}: the model it describes has {name} of shape {list(want)} but "
                f"{manifest.weights} stores {list(shape)}: the manifest does not describe these "
                f"weights; restore {manifest.path.name} from a good copy of the checkpoint")
    if extra and not allow_extra:
        raise ManifestMismatch(f"{manifest.path}: {manifest.weights} holds {len(extra)} "
                               "tensor(s) the model it describes does not have "
                               f"({_first(sorted(extra))})")
    needed = list(top) + [f"layers.{i}.{rest}" for i in range(args.n_layers) for rest in layer]
    missing = [name for name in needed if name not in stored]
    if missing:
        raise ManifestMismatch(
            f"{manifest.path}: {manifest.weights} lacks {len(missing)} tensor(s) of the model "
            f"it describes (missing tensor(s): {_first(missing)}): the manifest does not "
            "describe these weights, or the checkpoint is incomplete")


def _first(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


__all__ = ["Manifest", "ManifestMismatch", "check_layer_count", "check_stored_shapes",
           "expected_shapes", "layer_indices"]
