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

from mtp.eagle3 import Eagle3Draft
from rollout.embedded.proposers.drafting import DraftSteps, TrainedExternalDraft, draft_cache
from rollout.embedded.proposers.mtp import MTPProposer
from vime.errors import require
from vime.models.eagle3 import FLAG, check_draft_fits_target, load_draft, resolve_aux_layers
from vime.models.families import DRAFT_PREFIX


def load_eagle3_draft(path, target_cfg, dtype=torch.float32, device="cpu"):
    """The draft module of a draft directory, checked against the target's ModelConfig."""
    cfg, state = load_draft(path)
    check_draft_fits_target(path, cfg, target_cfg)
    draft = Eagle3Draft(resolve_aux_layers(cfg, target_cfg))
    require("embed_tokens.weight" not in state,
            f"{FLAG}: draft {path} stores its own embed_tokens; vime's EAGLE-3 draft reads the target's "
            "(remove the tensor from model.safetensors)")
    draft.load_state_dict(state, strict=True)
    return draft.to(device, dtype).eval().requires_grad_(False)


class Eagle3Proposer(TrainedExternalDraft, MTPProposer):
    """Drafts with an external EAGLE-3 draft from the target's aux hidden states (its own KV cache)."""

    wire_prefix = DRAFT_PREFIX

    def __init__(self, spec, draft=None, sample_drafts=False):
        super().__init__(spec, sample_drafts)
        self.draft_model = draft

    def attach(self, engine):
        self.engine = engine
        ec = engine.config
        if self.draft_model is None:
            self.draft_model = load_eagle3_draft(self.spec.model, engine.cfg, ec.dtype, ec.device)
        cfg = self.draft_model.cfg
        self.aux_hidden_layers = tuple(cfg.aux_layer_ids)
        self.num_layers = 1
        shape = dataclasses.replace(engine.cfg, num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
        self.cache = draft_cache(engine, 1, shape, self.num_speculative_tokens)
        self.steps = DraftSteps(engine, self.cache, self.step_forward)  # a dense draft: graphable
        self.carry = torch.zeros(ec.max_batch_size, 1, cfg.hidden_size, dtype=ec.dtype, device=ec.device)
        self.pending, self.deferred = {}, []
        self.synced = False

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

