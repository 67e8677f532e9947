"""Sequence classification: a linear head on the hidden state of the last non-padding token,
and the accuracy / macro-F1 of its predictions."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.models.args import ModelArgs


class SequenceClassifier(nn.Module):
    """`backbone` (a `Transformer`) + `score`, a bias-free linear layer to the label logits.

    Input rows are right-padded; `lengths` gives each row's number of real tokens. With causal
    attention the last real token has seen the whole text and none of the padding.
    The backbone's own output head is not used (nor trained).
    """

    def __init__(self, backbone: nn.Module, num_labels: int) -> None:
        super().__init__()
        if num_labels < 2:
            raise ValueError(f"classification needs at least 2 labels (got {num_labels})")
        self.backbone = backbone
        dim = backbone.args.dim
        weight = backbone.tok_embeddings.weight
        self.score = nn.Linear(dim, num_labels, bias=False,  # real even on a meta backbone
                               device="cpu" if weight.is_meta else weight.device,
                               dtype=weight.dtype)
        nn.init.normal_(self.score.weight, std=dim**-0.5)
        if not backbone.args.tie_embeddings:  # unused: keep it out of the optimizer
            backbone.output.requires_grad_(False)

    @property
    def args(self) -> ModelArgs:
        return self.backbone.args

    @property
    def num_labels(self) -> int:
        return self.score.out_features

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids and (batch,) lengths -> (batch, num_labels) logits."""
        hidden = self.backbone.hidden_states(tokens)
        last = (lengths - 1).clamp(min=0).to(hidden.device)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.score(pooled)


def classification_scores(preds: torch.Tensor, labels: torch.Tensor,
                          num_labels: int) -> dict[str, float]:
    """Accuracy and macro-F1 (the unweighted mean of per-label F1; a label that is neither
    predicted nor present counts as F1 = 0 only if it occurs in `labels` or `preds`)."""
    preds, labels = preds.cpu(), labels.cpu()
    accuracy = (preds == labels).float().mean().item() if len(labels) else 0.0
    f1s = []
    for c in range(num_labels):
        tp = int(((preds == c) & (labels == c)).sum())
        fp = int(((preds == c) & (labels != c)).sum())
        fn = int(((preds != c) & (labels == c)).sum())
        if tp + fp + fn == 0:
            continue
        f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": accuracy, "macro_f1": sum(f1s) / len(f1s) if f1s else 0.0}


__all__ = ["SequenceClassifier", "classification_scores"]
