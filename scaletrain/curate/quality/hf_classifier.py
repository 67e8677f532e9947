"""Scores from any local Hugging Face sequence-classification model (e.g. an educational-
quality classifier), in batches, on the GPU when there is one."""

from __future__ import annotations

from typing import Any

from scaletrain.curate.documents import Document
from scaletrain.curate.pipeline import Step


class HFClassifierScorer(Step):
    """Stores `metadata[key]`: the regression output (one label) or the probability of
    `label` (default: the last label). `model` is a local directory (offline)."""

    name = "hf_score"

    def __init__(
        self,
        model: str,
        key: str = "hf_score",
        label: str | int | None = None,
        batch_size: int = 16,
        max_length: int = 512,
        device: str | None = None,
    ):
        super().__init__()
        self.model_path, self.key, self.label = model, key, label
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self._tok: Any = None
        self._model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_tok": None, "_model": None}

    def _load(self) -> None:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as e:
            raise RuntimeError(
                "the HF scorer needs transformers: pip install 'scaletrain[hf]'"
            ) from e
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._tok = AutoTokenizer.from_pretrained(self.model_path)
        self._model = AutoModelForSequenceClassification.from_pretrained(self.model_path)
        self._model.to(device).eval()

    def scores(self, texts: list[str]) -> list[float]:
        import torch

        if self._model is None:
            self._load()
        enc = self._tok(
            texts, truncation=True, max_length=self.max_length, padding=True, return_tensors="pt"
        ).to(self._model.device)
        with torch.inference_mode():
            logits = self._model(**enc).logits.float()
        if logits.shape[-1] == 1:
            return logits[:, 0].tolist()
        probs = logits.softmax(-1)
        idx = (
            self.label
            if isinstance(self.label, int)
            else (
                self._model.config.label2id[self.label]
                if self.label is not None
                else logits.shape[-1] - 1
            )
        )
        return probs[:, idx].tolist()

    def process_batch(self, docs: list[Document]) -> list[Document | str]:
        for doc, s in zip(docs, self.scores([d.text for d in docs])):
            doc.metadata[self.key] = round(float(s), 5)
        return list(docs)

    def process(self, doc: Document) -> Document | str:
        return self.process_batch([doc])[0]
