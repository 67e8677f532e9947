"""scaletrain: train, plan, profile and feed Llama-style language models."""

__version__ = "0.1.0"
