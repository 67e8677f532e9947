"""Training data: tokenizers (`tokenizer`), documents -> Megatron indexed datasets (`tokenize`,
`indexed`), packed GPT samples (`gpt_dataset`), blending (`blend`), the sample orders of a run
(`sources`), the resumable data-parallel loader (`loader`) and the built-in corpus (`corpus`).

Nothing here imports torch.nn; only the loader hands tensors to `train/`.
"""
