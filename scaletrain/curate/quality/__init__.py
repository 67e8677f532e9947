"""Model-based quality: fastText classifier, KenLM perplexity, HF classifier, score filter."""

from scaletrain.curate.quality.fasttext_clf import FastTextScorer, train_classifier
from scaletrain.curate.quality.hf_classifier import HFClassifierScorer
from scaletrain.curate.quality.kenlm_ppl import PerplexityScorer
from scaletrain.curate.quality.threshold import ScoreFilter

__all__ = [
    "FastTextScorer",
    "HFClassifierScorer",
    "PerplexityScorer",
    "ScoreFilter",
    "train_classifier",
]
