"""Ragged token rows -> one right-padded tensor (the engine's batches and the proposers' drafts)."""
import torch


def pad_token_rows(rows, device, value=0):
    """[len(rows), longest row (at least 1)] long tensor, each row right-padded with `value`."""
    width = max(1, max(len(x) for x in rows))
    return torch.tensor([list(x) + [value] * (width - len(x)) for x in rows], dtype=torch.long, device=device)
