"""The MTP layer's input combination (DeepSeek-V3 / GLM-4.5 convention).

h' = eh_proj(cat(enorm(embedding of token t+1), hnorm(hidden at t))): embedding first.
Layouts that store the halves the other way round are converted on load (families.py).
"""
import torch


def combine_embedding_and_hidden(embeds, hidden, enorm, hnorm, eh_proj):
    """Project cat(enorm(embeds), hnorm(hidden)) back to the hidden size."""
    return eh_proj(torch.cat([enorm(embeds), hnorm(hidden)], dim=-1))
