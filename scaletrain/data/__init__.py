"""Training data: a tokenized, cached corpus (`corpus`) and the batch loader over it (`loader`).

This is the small built-in data path used by `scaletrain train`; it never imports torch.nn.
"""
