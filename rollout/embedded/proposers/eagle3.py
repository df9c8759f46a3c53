"""EAGLE-3 proposer: an external one-layer draft reads three target layers' hidden states.

It drafts exactly as vLLM's eagle3 path does. After a target forward, the draft runs over the
newly verified positions t (token t+1, h_t = fc(cat(aux hidden states at t))) into its own KV
cache; its output at the last position e gives draft 1, and each further draft runs the draft
one position further on its own output (the residual stream) and the previous draft. That is
the MTP proposer's bookkeeping for a single layer reused past itself (catch-up, reuse steps,
speculative cache entries overwritten by the next catch-up, k = 0 steps deferred), so this
proposer is that one with another network: the draft of mtp/eagle3.py, the target's embedding,
the draft's own norm and head.
"""
import dataclasses

import torch
import torch.nn.functional as F

from rollout.embedded.proposers.drafting import DraftSteps, ExternalDraft
from rollout.embedded.proposers.mtp import MTPProposer
from vime.models.eagle3 import EAGLE3


class Eagle3Proposer(ExternalDraft, MTPProposer):
    """Drafts with an external EAGLE-3 draft from the target's aux hidden states (its own KV cache)."""

    kind = EAGLE3

    def __init__(self, spec, draft=None, sample_drafts=False):
        super().__init__(spec, sample_drafts)
        self.draft_model = draft

    def attach(self, engine):
        super().attach(engine)  # the draft and its cache (drafting.py)
        self.num_layers = 1
        self.steps = DraftSteps(engine, self.cache, self.step_forward)  # a dense draft: graphable
        ec = engine.config
        self.carry = torch.zeros(ec.max_batch_size, 1, self.draft_model.cfg.hidden_size, dtype=ec.dtype,
                                 device=ec.device)
        self.pending, self.deferred = {}, []
        self.synced = False

    def draft_layers(self):
        return 1  # one decoder layer, reused past itself

    def catch_up(self, slots, out, token_rows):
        combined = self.draft_model.combine(out.hidden)
        return super().catch_up(slots, dataclasses.replace(out, hidden=combined), token_rows)

    def layer_forward(self, j, tokens, hidden, positions, view):
        embeds = F.embedding(tokens, self.engine.model.model.embed_tokens.weight)
        return self.draft_model(embeds, hidden, positions, view)

    def draft_logits(self, hidden):
        return self.draft_model.logits(hidden)

    def target_hidden_width(self):
        return len(self.aux_hidden_layers) * self.engine.cfg.hidden_size

