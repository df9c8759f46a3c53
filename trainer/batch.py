"""The training batch: built from `Sample` records in one place (right padding).

Every per-token tensor is [B, S] aligned with `tokens`; position j of `rollout_logprobs`
holds the rollout log-prob of token j (0 on prompt and padding). The loss uses the
label-aligned slices `[:, 1:]`. MoE rollouts add `routed_experts` [B, S, MoE layers, k]: the experts
the rollout chose at each position (NO_ROUTE on the last token and padding; vime/models/routing_replay.py).
"""
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from vime.models.routing_replay import NO_ROUTE, batch_routes

_PADDING = {"tokens": 0, "routed_experts": NO_ROUTE}  # what a padded position holds (others: 0 / False)


@dataclass
class Batch:
    """Right-padded [B, S] tensors of one training batch, aligned with `tokens`."""

    tokens: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] float, 1 on response tokens
    rollout_logprobs: torch.Tensor  # [B, S] float
    advantages: torch.Tensor  # [B, S] float, the sample's advantage on its response tokens
    token_mask: torch.Tensor  # [B, S] bool, True on the row's prompt and response tokens, False on padding
    ref_logprobs: Optional[torch.Tensor] = None  # [B, S] for the KL loss
    old_logprobs: Optional[torch.Tensor] = None  # [B, S] the trainer's before the step (--use-tis)
    routed_experts: Optional[torch.Tensor] = None  # [B, S, layers, k] int16, the rollout's routes (MoE)

    @property
    def size(self):
        return self.tokens.shape[0]

    @property
    def label_mask(self):
        """[B, S-1]: loss mask of the predicted tokens."""
        return self.loss_mask[:, 1:]

    def num_response_tokens(self):
        return self.label_mask.sum()

    def rows(self, start, end):
        return replace(self, **{f.name: getattr(self, f.name)[start:end] for f in fields(self)
                                if getattr(self, f.name) is not None})

    def to(self, device):
        """This batch with every tensor on `device` (itself when already there)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})

    @property
    def width(self):
        return self.tokens.shape[1]

    def padded_to(self, width):
        """This batch right-padded to `width` positions (padding is out of every mask: no loss, no
        expert load; causal attention keeps it out of the real positions)."""
        return self._padded(1, width - self.width)

    def with_rows(self, rows):
        """This batch with empty rows appended up to `rows` (padding everywhere: they add nothing to
        any loss, metric or expert-load count)."""
        return self._padded(0, rows - self.size)

    def _padded(self, dim, extra):
        """`extra` padding positions (dim 1) or rows (dim 0) appended to every tensor."""
        if extra <= 0:
            return self

        def pad(name, t):
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, torch.full(shape, _PADDING.get(name, 0), dtype=t.dtype, device=t.device)], dim=dim)

        return replace(self, **{f.name: pad(f.name, getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})

    def micro_batches(self, micro_batch_size):
        size = micro_batch_size if micro_batch_size and micro_batch_size > 0 else self.size
        return [self.rows(i, i + size) for i in range(0, self.size, size)]


def _row(values, offset, width, dtype, fill=0):
    row = torch.full((width,), fill, dtype=dtype)
    if values:
        row[offset:offset + len(values)] = torch.as_tensor(values, dtype=dtype)
    return row


def build_batch(samples, pad_token_id=0, ref_logprobs=None):
    """Batch of `samples` (vime.sample.Sample), right-padded to the longest."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)

    def stack(fn, dtype, fill=0):
        return torch.stack([fn(s, dtype, fill) for s in samples])

    tokens = stack(lambda s, d, f: _row(s.tokens, 0, width, d, f), torch.long, pad_token_id)
    mask = stack(lambda s, d, f: _row(s.loss_mask, 0, width, d), torch.float32)
    lps = stack(lambda s, d, f: _row(s.rollout_logprobs, len(s.prompt_ids), width, d), torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)[:, None] * mask
    real = torch.arange(width)[None, :] < torch.tensor([len(s.tokens) for s in samples])[:, None]
    return Batch(tokens=tokens, loss_mask=mask, rollout_logprobs=lps, advantages=adv, token_mask=real,
                 ref_logprobs=ref_logprobs, routed_experts=batch_routes(samples, width))
