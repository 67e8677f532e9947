"""Rotary position embeddings in the "rotate half" layout used by Hugging Face checkpoints."""

from __future__ import annotations

import math

import torch

from scaletrain.models.args import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                        long: bool = False) -> torch.Tensor:
    """Per-pair inverse frequencies, with Llama-3.1 frequency-dependent scaling or LongRoPE
    (short factors; the long ones with `long`) when given."""
    if scaling is not None and scaling.kind == "longrope":
        # In fp32 as transformers computes it, so long contexts rotate identically.
        ext = torch.tensor(scaling.long_factor if long else scaling.short_factor,
                           dtype=torch.float32)
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (ext * theta ** exponent)
    # fp32 throughout, as Meta's reference code and transformers compute them: a float64 table
    # differs by an ulp, which turns into cos/sin errors of ~1e-2 at positions near 128k.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, interpolated, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (*positions.shape, head_dim) for the given absolute positions
    (1-D positions shared by every row, or one row of positions per sequence), times `scale`
    (LongRoPE's attention factor)."""
    angles = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((angles, angles), dim=-1)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape (batch, heads, seq, head_dim) by (seq, head_dim) tables, or by
    per-sequence (batch, 1, seq, head_dim) tables."""
    return x * cos + _rotate_half(x) * sin
