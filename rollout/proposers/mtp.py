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

A step where the engine's k policy asks for no drafts (engine.step_k == 0) costs nothing
here: its hidden states are kept per slot and the next drafting step catches up over all
of them in its one catch-up forward, so the invariant holds whenever drafts are made.
"""
import torch

from rollout.proposers import ForwardOutput, Proposer
from rollout.proposers.drafting import assign_drafts, draft_cache, pad_rows, pick_drafts, uniforms_if_sampling


class MTPProposer(Proposer):
    def __init__(self, spec, sample_drafts=False):
        self.spec, self.sample_drafts = spec, sample_drafts  # see drafting.py for the choice
        self.num_speculative_tokens = spec.num_speculative_tokens

    def attach(self, engine):
        self.engine, self.model = engine, engine.model
        self.num_layers = self.model.num_mtp_layers
        self.cache = draft_cache(engine, self.num_layers, engine.cfg, self.num_speculative_tokens)
        self.pending = {}  # slot -> (first position not caught up, [hidden states since]) for k = 0 steps

    def release(self, request):
        self.pending.pop(request.slot, None)

    def propose(self, out):
        k = min(self.num_speculative_tokens, self.engine.step_k)
        if k == 0:
            self.defer(out)
            return
        out = self.with_pending(out)
        reqs = out.requests
        sampling = reqs[0].sampling
        uniforms = uniforms_if_sampling(self.spec, reqs, k, self.sample_drafts)
        slots = torch.tensor([r.slot for r in reqs], device=out.hidden.device)
        hidden, pos = self.catch_up(reqs, slots, out)
        tokens, probs = [], []
        for i in range(k):
            tok, q = pick_drafts(self.engine.fast.logits(hidden), sampling, None if uniforms is None else uniforms[:, i])
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                hidden = self.chain_step(min(i + 1, self.num_layers - 1), slots, tok, hidden, pos + i + 1)
        assign_drafts(reqs, torch.stack(tokens, 1), torch.stack(probs, 1) if uniforms is not None else None)

    def with_pending(self, out):
        """`out` extended backwards by the hidden states that k = 0 steps left un-caught-up."""
        if not any(r.slot in self.pending for r in out.requests):
            return out
        rows, starts = [], []
        for i, r in enumerate(out.requests):
            start, parts = self.pending.pop(r.slot, (int(out.starts[i]), []))
            rows.append(torch.cat(parts + [out.hidden[i, :int(out.n_valid[i])]]))
            starts.append(start)
        hidden = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        lengths = torch.tensor([len(x) for x in rows], device=hidden.device)
        return ForwardOutput(out.requests, hidden, torch.tensor(starts, device=hidden.device), lengths)

    def defer(self, out):
        """Keep this step's hidden states for the next drafting step (views: each forward's
        output is a fresh tensor, never written again)."""
        starts, n_valid = out.starts.tolist(), out.n_valid.tolist()
        for i, r in enumerate(out.requests):
            self.pending.setdefault(r.slot, (starts[i], []))[1].append(out.hidden[i, :n_valid[i]])
            r.drafts, r.draft_probs = [], None

    def profile_draft(self, batch_size, k, new_tokens=2):
        """One drafting of k tokens for batch_size rows (catch-up over `new_tokens` verified
        positions, k-1 chain steps, k heads) on dummy inputs in slots 0..batch_size-1."""
        dev, hidden_size = self.engine.config.device, self.engine.cfg.hidden_size
        slots = torch.arange(batch_size, device=dev)
        context = max(0, min(32, self.engine.max_len - new_tokens - k))
        starts = torch.full((batch_size,), context, device=dev)
        n_valid = torch.full((batch_size,), new_tokens, device=dev)
        hidden = torch.zeros(batch_size, new_tokens, hidden_size, device=dev, dtype=self.engine.config.dtype)
        tokens = torch.zeros(batch_size, new_tokens, dtype=torch.long, device=dev)
        positions = starts[:, None] + torch.arange(new_tokens, device=dev)[None, :]
        with torch.inference_mode():
            views = self.cache.step(slots, starts, n_valid, self.engine.backend).layers(self.num_layers)
            out = [self.engine.fast.mtp(j, tokens, hidden, positions, views[j]) for j in range(self.num_layers)][0][:, -1]
            for i in range(k):
                tok = self.engine.fast.logits(out).argmax(-1)
                if i + 1 < k:
                    out = self.chain_step(min(i + 1, self.num_layers - 1), slots, tok, out, starts + new_tokens + i)

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
