"""MTP proposer: the policy's own MTP layers draft k tokens per request, batched.

Position bookkeeping (n = len(all_ids) after a target forward). The MTP layer at position
p reads the target's final hidden state h_p and the embedding of token p+1 and predicts
token p+2. Each target forward brings h for `n_valid` new positions starting at `start`
(whose next tokens are now known), so one batched "catch-up" MTP forward writes those
positions into the MTP KV cache from true inputs only; its output at the last of them
(p = n-2) gives draft 1. Drafts 2..k chain vLLM-style: the MTP output at p stands in for
h_{p+1} and the previous draft for token p+2, one position further each step (depth i
uses MTP layer min(i, L-1), so with one layer it is reused on its own output). Those chain
entries are speculative, but they sit at positions >= n-1, which is exactly where the next
catch-up starts writing, so they are always overwritten before they are read as context.
Invariant: after propose, MTP cache entries at positions < n-1 come from (h_p, token p+1).
With several MTP layers every layer's cache is caught up on the same true inputs.
"""
import torch

from rollout.proposers import Proposer
from rollout.proposers.drafting import assign_drafts, draft_cache, pad_rows, pick_drafts, uniforms_if_sampling


class MTPProposer(Proposer):
    def __init__(self, spec, sample_drafts=False):
        self.spec, self.sample_drafts = spec, sample_drafts  # see drafting.py for the choice
        self.num_speculative_tokens = spec.num_speculative_tokens

    def attach(self, engine):
        self.engine, self.model = engine, engine.model
        self.num_layers = self.model.num_mtp_layers
        self.cache = draft_cache(engine, self.num_layers, engine.cfg, self.num_speculative_tokens)

    def propose(self, out):
        reqs, k = out.requests, self.num_speculative_tokens
        sampling = reqs[0].sampling
        uniforms = uniforms_if_sampling(self.spec, reqs, k, self.sample_drafts)
        slots = torch.tensor([r.slot for r in reqs], device=out.hidden.device)
        hidden, pos = self.catch_up(reqs, slots, out)
        tokens, probs = [], []
        for i in range(k):
            tok, q = pick_drafts(self.model.logits(hidden), sampling, None if uniforms is None else uniforms[:, i])
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                hidden = self.chain_step(min(i + 1, self.num_layers - 1), slots, tok, hidden, pos + i + 1)
        assign_drafts(reqs, torch.stack(tokens, 1), torch.stack(probs, 1) if uniforms is not None else None)

    def catch_up(self, reqs, slots, out):
        """MTP forward over the newly verified positions (true inputs); returns the output at
        the last one [B, H] and its position [B]."""
        starts, n_valid = out.starts, out.n_valid
        bounds = zip(starts.tolist(), n_valid.tolist())
        next_tokens = pad_rows([r.all_ids[s + 1:s + 1 + n] for r, (s, n) in zip(reqs, bounds)], slots.device)
        q_len = next_tokens.shape[1]
        positions = starts[:, None] + torch.arange(q_len, device=slots.device)[None, :]
        views = self.cache.step(slots, starts, n_valid, self.engine.backend).layers(self.num_layers)
        hidden = out.hidden[:, :q_len]
        results = [self.engine.fast.mtp(j, next_tokens, hidden, positions, views[j]) for j in range(self.num_layers)]
        last = n_valid - 1
        rows = torch.arange(len(reqs), device=slots.device)
        return results[0][rows, last], starts + last

    def chain_step(self, layer, slots, tokens, hidden, positions):
        """One speculative MTP step per request at `positions` [B]: (previous output, draft)."""
        view = self.cache.step(slots, positions, torch.ones_like(positions), self.engine.backend)
        out = self.engine.fast.mtp(layer, tokens[:, None], hidden[:, None], positions[:, None],
                                     view.layers(self.num_layers)[layer])
        return out[:, 0]


def reference_mtp_drafts(model, ids, k):
    """Greedy MTP drafts for the sequence `ids` recomputed from scratch without any cache
    (the naive path the cached proposer is tested against)."""
    n = len(ids)
    tokens = torch.tensor([ids])
    positions = torch.arange(n)[None]
    with torch.inference_mode():
        _, h = model.forward_states(tokens, positions)
        hidden, next_tokens = h[:, :n - 1], tokens[:, 1:]
        drafts = []
        for i in range(k):
            layer = min(i, model.num_mtp_layers - 1)
            pos = torch.arange(hidden.shape[1])[None]
            out = model.mtp_forward(layer, next_tokens, hidden, pos)
            d = int(model.logits(out[0, -1]).argmax())
            drafts.append(d)
            hidden = torch.cat([hidden, out[:, -1:]], 1)
            next_tokens = torch.cat([next_tokens, torch.tensor([[d]])], 1)
    return drafts
