"""Model-based quality: fastText classifier, KenLM perplexity, HF classifier, score filter."""

from scaletrain.data.quality.fasttext_clf import FastTextScorer, train_classifier
from scaletrain.data.quality.hf_classifier import HFClassifierScorer
from scaletrain.data.quality.kenlm_ppl import PerplexityScorer
from scaletrain.data.quality.threshold import ScoreFilter

__all__ = [
    "FastTextScorer",
    "HFClassifierScorer",
    "PerplexityScorer",
    "ScoreFilter",
    "train_classifier",
]
