"""The MTP layer's input combination (DeepSeek-V3 / GLM-4.5 convention).

h' = eh_proj(cat(enorm(embedding of token t+1), hnorm(hidden at t))): embedding first.
Layouts that store the halves the other way round are converted on load (families.py).
Families whose drafter sees no token at the first position (MiMo, as vLLM runs it) zero
the embedding of the pair at position 0 (`zero_embedding_at_position_0`).
"""
import torch


def combine_embedding_and_hidden(embeds, hidden, enorm, hnorm, eh_proj):
    """Project cat(enorm(embeds), hnorm(hidden)) back to the hidden size."""
    return eh_proj(torch.cat([enorm(embeds), hnorm(hidden)], dim=-1))


def zero_embedding_at_position_0(embeds, positions):
    """embeds [..., Q, H] with the rows whose position (of the hidden state t) is 0 set to zero."""
    return embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
