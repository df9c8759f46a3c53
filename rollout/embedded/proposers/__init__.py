"""Draft proposers for speculative decoding, one registry for all methods.

A proposer sees every target forward (`TargetForward`: the hidden states of the new
positions that the family's first MTP layer reads — or, for a proposer naming
`aux_hidden_layers`, those layers' hidden states concatenated — and how many of them are now followed by a known token) and leaves on
each request the drafts for its next verify step (`request.drafts`, and
`request.draft_probs` [k, V] when it has a draft distribution). The engine verifies them.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from vime.lazy import lazy_constructor
from vime.models.draft_kinds import DRAFT_KINDS


@dataclass
class TargetForward:
    """What a proposer sees of one target forward over a ragged batch of requests.

    `hidden` may be a step's output buffer (rollout/embedded/steps.py), rewritten by the next
    target step: a proposer that keeps it past its `propose` keeps a copy."""

    requests: list
    hidden: torch.Tensor  # [B, Q, H] the new positions' hidden states as the first MTP layer reads them
    starts: torch.Tensor  # [B] position of hidden[:, 0]
    n_valid: torch.Tensor  # [B] leading positions whose next token is now known
    host_starts: Optional[list] = None  # the same on the host (read back from the tensors when not given)
    host_n_valid: Optional[list] = None

    def host_lengths(self):
        """(starts, n_valid) as host ints: what a proposer lays its own steps out with."""
        if self.host_starts is None:
            self.host_starts, self.host_n_valid = self.starts.tolist(), self.n_valid.tolist()
        return self.host_starts, self.host_n_valid


class Proposer:
    """No speculation: plain decoding is verification with zero drafts."""

    num_speculative_tokens = 0
    aux_hidden_layers = ()  # target layers whose hidden states it reads instead (an external draft's)
    # True: it works at every step, also one the k policy gives no drafts (DFlash writes its
    # context), and its profile_draft(batch_size, 0) prices that work
    costs_at_k0 = False
    # True: its drafts depend on earlier generates' outputs (suffix decoding's cache of responses)
    remembers_outputs = False

    def attach(self, engine):
        """Called once the engine exists (allocate caches, read the model)."""

    def propose(self, out):
        for r in out.requests:
            r.drafts, r.draft_probs = [], None

    def release(self, request):
        """The request finished: drop its per-request state."""

    def kv_caches(self):
        """The KV caches this proposer keeps (its `cache`, when it has one): released with the engine's."""
        cache = getattr(self, "cache", None)
        return [cache] if cache is not None else []

    def named_draft_weights(self):
        """(wire name, tensor) of an external draft the trainer trains and syncs, once it has
        synced it (a frozen draft has nothing on the trainer to compare with)."""
        return []

    def loadable_draft_weights(self):
        """{wire name: parameter} a weight sync may write into (an external draft's)."""
        return {}

    def draft_synced(self):
        """A weight sync wrote the external draft."""

    def move_slots(self, requests, old_slots):
        """The engine moved each of `requests` from its old slot to `request.slot` (a free one):
        move what this proposer keeps per slot."""


# every kind's proposer (rollout/embedded/proposers/<kind>.py, its class named by the kind's descriptor),
# imported only when that method is asked for
PROPOSERS = {"none": lambda spec_config: Proposer(),
             **{name: lazy_constructor(f"rollout.embedded.proposers.{name}", kind.proposer)
                for name, kind in DRAFT_KINDS.items()}}
