"""Synthetic data: generate candidates with an LLM, critique them, filter, monitor.

Generation runs through `scaletrain.inference` (in-process batched generation) or
`http_client` (any OpenAI-compatible server); prompts (templates filled from seed data),
critique (LLM-as-judge, classifier), filters (threshold, curation steps, MinHash dedup, n-gram
decontamination), monitor (statistics + report), runner (resumable loop).
"""
