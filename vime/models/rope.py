"""Rotary position tables: plain RoPE, DeepSeek-V3's YaRN and Llama 3's frequency scaling (pure torch).

`rotary_inv_freq(dim, theta, yarn, llama3)` gives the inverse frequencies of `dim` rotated channels
and the factor cos/sin are multiplied by; `yarn_softmax_scale` the attention's softmax scale, which
YaRN multiplies by mscale(factor, mscale_all_dim)^2 (DeepSeek-V3's config: factor 40,
mscale = mscale_all_dim = 1, so cos/sin stay unscaled and only the softmax scale grows).
The formulas are YaRN's (Peng et al. 2023) as DeepSeek-V3 and transformers apply them. Llama 3.1+
(`rope_type: llama3`) keeps the high frequencies, divides the low ones by `factor` and blends the band
between (transformers' `_compute_llama3_parameters`, megatron-core's `RotaryEmbedding._apply_scaling`).
"""
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    """The YaRN `rope_scaling` block of a DeepSeek-V3 config."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float = None  # explicit cos/sin factor; None: derived from mscale / mscale_all_dim
    truncate: bool = True  # round the ramp's ends to whole channels (YaRN's default)


@dataclass(frozen=True)
class Llama3Scaling:
    """The `rope_type: llama3` block of a Llama 3.1+ config."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def llama3_inv_freq(inv_freq, scaling):
    """Llama 3's scaled inverse frequencies: wavelengths shorter than original / high_freq_factor kept,
    longer than original / low_freq_factor divided by `factor`, the band between blended linearly in
    original / wavelength (the same float32 operations as transformers)."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale, mscale=1.0):
    """YaRN's attention temperature correction 0.1 * mscale * ln(scale) + 1 (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_range(yarn, dim, theta):
    """(low, high) channel-pair indices between which frequencies blend from extrapolated to interpolated."""
    def channel(rotations):
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = channel(yarn.beta_fast), channel(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rotary_inv_freq(dim, theta, yarn=None, llama3=None):
    """(inverse frequencies [dim // 2], cos/sin factor) for `dim` rotated channels."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if llama3 is not None:
        return llama3_inv_freq(1.0 / base, llama3), 1.0
    if yarn is None:
        return 1.0 / base, 1.0
    low, high = _correction_range(yarn, dim, theta)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1: keep the trained frequency, 0: stretch it by the factor
    inv_freq = (1.0 / (yarn.factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated
    factor = yarn.attention_factor
    if factor is None:
        factor = (yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
                  if yarn.mscale and yarn.mscale_all_dim else yarn_mscale(yarn.factor))
    return inv_freq, float(factor)


def yarn_softmax_scale(head_dim, yarn=None):
    """The attention softmax scale: head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = head_dim ** -0.5
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale
