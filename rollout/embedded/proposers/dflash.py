"""DFlash proposer: an external block-diffusion draft proposes a whole block in one forward.

It drafts as vLLM's dflash path does (vllm/v1/spec_decode/dflash.py). After every target
forward (prefill or verify), the newly verified positions' target states (the draft's
`target_layer_ids`, concatenated) become context: each draft layer's key and value of
hidden_norm(fc(states)) are written into the draft's own KV cache at those positions. That
happens at every step, also where the k policy asks for no drafts, so the cache is always
complete and there is nothing to catch up. To draft, one forward runs the block [newest token,
mask x k] at positions n-1 .. n-1+k over the cached context (positions < n-1) and the block
itself, with no causal mask inside the block; the logits at block slot i are draft i.
The block's own keys are never cached: the next step's context overwrites those positions.
Drafts are verified exactly as every proposer's (rejection sampler of mtp/); sampled drafts
come with their distribution q, each slot's drawn independently (the draft reads no draft).
"""
import torch

from rollout.embedded.steps import device_tensor
from rollout.embedded.proposers import Proposer
from rollout.embedded.proposers.drafting import (DRAFT_ATTENTION, ExternalDraft, assign_drafts, draft_family,
                                                 pick_drafts, uniforms_if_sampling)
from vime.models.dflash import DFLASH


class DFlashProposer(ExternalDraft, Proposer):
    """Drafts a block per request in one forward of an external DFlash draft (its own KV cache of context)."""

    kind = DFLASH
    costs_at_k0 = True  # the context write runs at every step: a step without drafts is not plain decoding

    def __init__(self, spec, draft=None, sample_drafts=False):
        self.spec, self.draft_model, self.sample_drafts = spec, draft, sample_drafts  # see drafting.py
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.synced = False

    def attach(self, engine):
        super().attach(engine)  # the draft and its cache (drafting.py)
        self.family = draft_family()

    # ---- weight sync (an external draft the trainer trains) ----
    def move_slots(self, requests, old_slots):
        self.cache.move_slots(old_slots, [r.slot for r in requests], max(r.num_tokens for r in requests))

    # ---- drafting ----
    def propose(self, out):
        reqs = out.requests
        slots = [r.slot for r in reqs]
        starts, n_valid = out.host_lengths()
        self.write_context(slots, out.hidden, starts, n_valid)
        k = min(self.num_speculative_tokens, self.engine.step_k)
        if k == 0:
            return super().propose(out)  # no drafts this step
        logits = self.block_logits(slots, [r.all_ids[-1] for r in reqs], [s + v for s, v in zip(starts, n_valid)])
        uniforms = uniforms_if_sampling(self.spec, reqs, k, self.sample_drafts)
        picked = [pick_drafts(logits[:, 1 + i], reqs[0].sampling, None if uniforms is None else uniforms[:, i])
                  for i in range(k)]
        tokens = torch.stack([t for t, _ in picked], 1)
        assign_drafts(reqs, tokens, torch.stack([q for _, q in picked], 1) if uniforms is not None else None)

    def write_context(self, slots, hidden, starts, n_valid):
        """Every draft layer's keys/values of the verified positions starts .. starts+n_valid-1 into
        the cache (a static step; slots, starts, n_valid: host ints, hidden [n, >= max n_valid, W])."""
        width = max(n_valid)
        if width == 0:
            return
        layout = self.engine.steps.layout(self.cache, slots, starts, n_valid)
        shape = layout.shape

        def step(hidden, slots, starts):
            view = self.cache.static_step(slots, starts, shape, DRAFT_ATTENTION)
            kv = self.draft_model.context_kv(self.draft_model.context(hidden), view.positions)
            for j, (k, v) in enumerate(kv):
                view.write(self.cache.k[j], k.transpose(1, 2))
                view.write(self.cache.v[j], v.transpose(1, 2))
            return ()
        self.engine.steps.run((f"{self.family}/context", shape), step,
                              (layout.pad(hidden[:, :width]), layout.slots, layout.starts), layout.graphed)

    def block_logits(self, slots, anchor_tokens, anchors):
        """[n, block_size, V] logits of the block [anchor, mask x k] at positions anchors .. anchors+k,
        over the cached context before each anchor and the whole block (not causal); slots,
        anchor_tokens, anchors: host ints. A static step that reads the cache and writes nothing."""
        return self.block_forward(slots, anchor_tokens, anchors)[0]

    def block_forward(self, slots, anchor_tokens, anchors, with_states=False):
        """(the block's logits [n, block_size, V], and with `with_states` its final-normed states
        [n, block_size, H]) of `block_logits`' step; outputs a graph's buffers: use them before the next."""
        layout = self.engine.steps.layout(self.cache, slots, anchors, [0] * len(slots))
        shape, size = layout.shape, self.draft_model.cfg.block_size

        def step(anchor_tokens, slots, anchors):
            draft, target = self.draft_model, self.engine.model
            view = self.cache.static_step(slots, anchors, shape, DRAFT_ATTENTION)
            kv = [(view.read(self.cache.k[j]).transpose(1, 2), view.read(self.cache.v[j]).transpose(1, 2))
                  for j in range(draft.cfg.num_hidden_layers)]
            context = torch.arange(shape.k_len, device=anchors.device)[None, :] < anchors[:, None]
            mask = torch.cat([context[:, None, :].expand(-1, size, -1),
                              torch.ones(shape.rows, size, size, dtype=torch.bool, device=anchors.device)], 2)
            positions = anchors[:, None] + torch.arange(size, device=anchors.device)[None, :]
            states = draft(draft.block_input(anchor_tokens, target.model.embed_tokens.weight), positions, kv, mask)
            logits = draft.logits(states, target.head_weight())
            return (logits, states) if with_states else (logits,)
        tokens = device_tensor(anchor_tokens + [0] * (shape.rows - layout.n), layout.slots.device)
        outputs = self.engine.steps.run((f"{self.family}/block", shape, with_states), step,
                                        (tokens, layout.slots, layout.starts), layout.graphed)
        return tuple(x[:layout.n] for x in outputs)

    def profile_draft(self, batch_size, k, new_tokens=2):
        """One drafting for batch_size rows (context for `new_tokens` verified positions, the block
        forward) on dummy inputs in slots 0..batch_size-1. The block costs the same for any k >= 1;
        k = 0 is the context write alone, what a step without drafts still does."""
        with torch.inference_mode():
            slots, anchors = self.profile_context(batch_size, new_tokens)
            if k > 0:
                self.block_logits(slots, [0] * batch_size, anchors)

    def profile_context(self, batch_size, new_tokens):
        """The context write of `new_tokens` dummy verified positions for batch_size rows in slots
        0..batch_size-1 (the probes'); returns (the slots, the positions of their blocks' anchors)."""
        ec = self.engine.config
        slots = list(range(batch_size))
        context = max(0, min(32, self.engine.max_len - new_tokens - self.num_speculative_tokens - 1))
        width = len(self.aux_hidden_layers) * self.engine.cfg.hidden_size
        hidden = torch.zeros(batch_size, new_tokens, width, device=ec.device, dtype=ec.dtype)
        self.write_context(slots, hidden, [context] * batch_size, [new_tokens] * batch_size)
        return slots, [context + new_tokens] * batch_size
