"""Synthetic data: generate candidates with an LLM, critique them, filter, monitor.

generators (in-process batched generation, OpenAI-compatible HTTP), prompts (templates filled
from seed data), critique (LLM-as-judge, classifier), filters (threshold, curation steps,
MinHash dedup, n-gram decontamination), monitor (statistics + report), runner (resumable loop).
"""
