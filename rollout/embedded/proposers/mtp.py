"""MTP proposer: the policy's own MTP layers draft k tokens per request, batched.

Chaining (DeepSeek-V3, as megatron-core trains it): MTP layer j (0-based) at position t
reads h^j_t and the embedding of token t+j+1 and predicts token t+j+2, where h^0 is the
trunk's hidden state as the family's first MTP layer reads it (`TargetForward.hidden`) and
h^j (j >= 1) is layer j-1's output at the same position t. Each
layer keeps its own KV cache at positions t (rotary position t, as in megatron).

Bookkeeping (e = the last position whose next token is known after a target forward,
i.e. n-2 for n = len(all_ids)). A target forward brings trunk states for positions
start..e. The "catch-up" then writes every layer's cache from true inputs only: layer j
needs token t+j+1, so it is true up to position e-j, and this round covers start-j..e-j
(clamped at 0). Its hidden input there is layer j-1's output, all from this round except
at start-j, the last position layer j-1 covered in the previous round: that one output
per layer is carried per slot (`carry`).

Drafting at position e: layer 0's output at e gives draft 1. Layer j (j = 1..L-1) then
runs over positions e-j+1..e, whose tokens are drafts 1..j and whose hidden inputs are
layer j-1's true output at e-j+1 followed by its speculative outputs at e-j+2..e; its
output at e gives draft j+1. Past the last layer, drafts continue vLLM-style: the last
layer is reused one position further on its own output and the previous draft (with a
single MiMo-style layer this is the whole chain). Speculative entries of layer j sit at
positions >= e-j+1 = next start - j, exactly where the next catch-up of that layer starts
writing, so they are overwritten before being read as context.

A step where the engine's k policy asks for no drafts (engine.step_k == 0) costs nothing
here: its hidden states are kept (one record per step) and the next drafting step catches up
over all of them in its one catch-up forward (the carry is then the output at the position just
before them), so the invariant holds whenever drafts are made. A generate whose k policy drafts at
none of its steps (`drafts_this_generate`) keeps nothing.
"""
from dataclasses import dataclass

import torch

from rollout.embedded.proposers import TargetForward, Proposer
from rollout.embedded.steps import device_tensor
from rollout.embedded.proposers.drafting import (DraftSteps, assign_drafts, draft_cache, pick_drafts,
                                                 uniforms_if_sampling)


@dataclass
class LayerRun:
    """One MTP layer's forward over a ragged range: row b covers positions first[b] .. first[b]+count[b]-1."""

    out: torch.Tensor  # [B, Q, H]
    first: torch.Tensor  # [B]
    count: torch.Tensor  # [B]

    def last(self):
        """[B, H] output at each row's last covered position (row 0's garbage where count is 0)."""
        rows = torch.arange(self.out.shape[0], device=self.out.device)
        return self.out[rows, (self.count - 1).clamp(min=0)]


def shift_rows(x, offset):
    """x [B, Q, ...] with row b read from index i + offset[b] (clamped into range)."""
    q = x.shape[1]
    idx = (torch.arange(q, device=x.device)[None, :] + offset[:, None]).clamp(0, q - 1)
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


class MTPProposer(Proposer):
    """Drafts with the policy's own MTP layers, chained over depths, from the target forward's hidden states.

    Every layer forward is a static step (rollout/embedded/steps.py) laid out from host ints: the
    requests' slots, the positions each layer covers (`TargetForward.host_lengths`)."""

    def __init__(self, spec, sample_drafts=False):
        self.spec, self.sample_drafts = spec, sample_drafts  # see drafting.py for the choice
        self.num_speculative_tokens = spec.num_speculative_tokens

    def attach(self, engine):
        self.engine, self.model = engine, engine.model
        self.num_layers = self.model.num_mtp_layers
        self.cache = draft_cache(engine, self.num_layers, engine.cfg, self.num_speculative_tokens)
        self.steps = DraftSteps(engine, self.cache, self.step_forward, engine.graphable)
        cfg, ec = engine.cfg, engine.config
        # carry[slot, j]: layer j's output at the last position its catch-up covered (read by layer j+1)
        self.carry = torch.zeros(ec.max_batch_size, max(self.num_layers - 1, 1), cfg.hidden_size,
                                 dtype=ec.dtype, device=ec.device)
        self.pending = {}  # slot -> first position not caught up, for slots deferred by k = 0 steps
        self.deferred = []  # one (TargetForward, its starts as a list) per k = 0 step, until caught up

    def release(self, request):
        self.pending.pop(request.slot, None)
        if not self.pending:
            self.deferred.clear()

    def move_slots(self, requests, old_slots):
        new_slots = [r.slot for r in requests]
        self.cache.move_slots(old_slots, new_slots, self.cache.max_len)
        self.carry[new_slots] = self.carry[old_slots]
        moved = {new: self.pending.pop(old) for old, new in zip(old_slots, new_slots) if old in self.pending}
        self.pending.update(moved)

    def propose(self, out):
        k = min(self.num_speculative_tokens, self.engine.step_k)
        if k == 0:
            self.defer(out)
            return
        out = self.with_pending(out)
        reqs = out.requests
        sampling = reqs[0].sampling
        uniforms = uniforms_if_sampling(self.spec, reqs, k, self.sample_drafts)
        slots = [r.slot for r in reqs]
        runs = self.catch_up(slots, out, self.true_tokens(reqs))
        starts, n_valid = out.host_lengths()
        tokens, probs = self.draft(runs, slots, [s + v - 1 for s, v in zip(starts, n_valid)], k, sampling, uniforms)
        assign_drafts(reqs, torch.stack(tokens, 1), torch.stack(probs, 1) if uniforms is not None else None)

    def with_pending(self, out):
        """`out` extended backwards by the hidden states that k = 0 steps left un-caught-up."""
        starts = [self.pending.pop(r.slot, None) for r in out.requests]
        if all(s is None for s in starts):
            return out
        # id(request) -> (its first deferred position, its deferred hidden states in step order)
        parts = {id(r): (s, []) for r, s in zip(out.requests, starts) if s is not None}
        for step, step_starts in self.deferred:
            _, step_valid = step.host_lengths()
            for i, r in enumerate(step.requests):
                first, rows = parts.get(id(r), (None, None))
                if rows is not None and step_starts[i] >= first:  # not from an earlier, caught-up deferral
                    rows.append(step.hidden[i, :step_valid[i]])
        if not self.pending:
            self.deferred.clear()
        out_starts, out_valid = out.host_lengths()
        rows = [out.hidden[i, :out_valid[i]] for i in range(len(out.requests))]
        rows = [row if s is None else torch.cat(parts[id(r)][1] + [row])
                for r, s, row in zip(out.requests, starts, rows)]
        starts = [out_starts[i] if s is None else s for i, s in enumerate(starts)]
        lengths = [len(x) for x in rows]
        hidden = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        return TargetForward(out.requests, hidden, device_tensor(starts, hidden.device),
                             device_tensor(lengths, hidden.device), starts, lengths)

    def defer(self, out):
        """Keep this step's hidden states for the next drafting step: one record per step, not
        per row (this runs at every k = 0 step, so on a large batch its cost is plain decoding's
        overhead). A copy: the target step's output buffer is rewritten by its next step. Nothing
        is kept in a generate that drafts at no step (`engine.may_draft`): no catch-up can come in it."""
        for r in out.requests:
            r.drafts, r.draft_probs = [], None
        if not self.engine.may_draft:
            return
        starts, n_valid = out.host_lengths()
        kept = TargetForward(out.requests, out.hidden.clone(), out.starts, out.n_valid, starts, n_valid)
        self.deferred.append((kept, starts))
        for r, start in zip(out.requests, starts):
            self.pending.setdefault(r.slot, start)

    def profile_draft(self, batch_size, k, new_tokens=2):
        """One drafting of k tokens for batch_size rows (catch-up over `new_tokens` verified
        positions, the deeper layers' and reuse steps, k heads) on dummy inputs in slots 0..batch_size-1."""
        dev, hidden_size = self.engine.config.device, self.target_hidden_width()
        context = max(0, min(32, self.engine.max_len - new_tokens - k - self.num_layers))
        starts, n_valid = [context] * batch_size, [new_tokens] * batch_size
        hidden = torch.zeros(batch_size, new_tokens, hidden_size, device=dev, dtype=self.engine.config.dtype)
        out = TargetForward(None, hidden, device_tensor(starts, dev), device_tensor(n_valid, dev),
                            starts, n_valid)
        slots = list(range(batch_size))
        with torch.inference_mode():
            runs = self.catch_up(slots, out, lambda j, first, count: [[0] * c for c in count])
            self.draft(runs, slots, [context + new_tokens - 1] * batch_size, k, None, None)

    def draft(self, runs, slots, last_pos, k, sampling, uniforms):
        """k drafts per row from the caught-up layers (see the module docstring): ([B] tokens, [B, V] q or None) x k.
        slots, last_pos: host ints per row."""
        tokens, probs = [], []

        def draft(hidden_at_last):
            tok, q = pick_drafts(self.draft_logits(hidden_at_last), sampling,
                                 None if uniforms is None else uniforms[:, len(tokens)])
            tokens.append(tok)
            probs.append(q)

        draft(runs[0].last())
        speculative = runs[0].out[:, :0]  # layer j's speculative outputs at e-j+1..e (none for layer 0)
        for j in range(1, min(self.num_layers, k)):
            speculative = self.deeper_layer_step(j, slots, last_pos, runs[j - 1].last(), speculative,
                                                 torch.stack(tokens, 1))
            draft(speculative[:, -1])
        hidden = speculative[:, -1] if speculative.shape[1] else runs[0].last()
        layer = self.num_layers - 1
        for i in range(len(tokens), k):
            # the step's output buffer is this hidden: read by the head and copied in by the next step
            hidden = self.reuse_step(layer, slots, tokens[-1], hidden, [p + i - layer for p in last_pos])
            draft(hidden)
        return tokens, probs

    def step_forward(self, j, tokens, hidden, positions, view):
        """What a draft step runs (DraftSteps): layer j on its slice of the step's cache view."""
        return self.layer_forward(j, tokens, hidden, positions, view.layers(self.num_layers)[j])

    # ---- the draft network (a subclass drafting with another network overrides these) ----
    def layer_forward(self, j, tokens, hidden, positions, view):
        """Draft layer j over (tokens t+j+1, hidden at t) at `positions`, writing its cache `view`."""
        return self.engine.fast.mtp(j, tokens, hidden, positions, view)

    def draft_logits(self, hidden):
        """Next-token logits from a draft layer's output."""
        return self.engine.fast.logits(hidden)

    def target_hidden_width(self):
        """Width of the target hidden states this proposer reads (TargetForward.hidden)."""
        return self.engine.cfg.hidden_size

    # ---- catch-up: every layer's cache from true inputs --------------------------------
    @staticmethod
    def true_tokens(reqs):
        """token_rows(j, first, count): layer j's input tokens t+j+1 for t = first..first+count-1 (host lists)."""
        def token_rows(j, first, count):
            return [r.all_ids[f + j + 1:f + j + 1 + c] for r, f, c in zip(reqs, first, count)]
        return token_rows

    def catch_up(self, slots, out, token_rows):
        """Run each layer over its newly true positions; returns one LayerRun per layer (slots: host ints)."""
        starts, n_valid = out.host_lengths()
        last0 = [s + v - 1 for s, v in zip(starts, n_valid)]
        q_len = max(n_valid)
        runs = []
        for j in range(self.num_layers):
            first = [max(s - j, 0) for s in starts]
            count = [max(last - j - f + 1, 0) for last, f in zip(last0, first)]
            if j == 0:
                hidden = out.hidden[:, :q_len]
            else:
                hidden = self._chained_input(runs[-1], slots, j, first)
            runs.append(self._run_layer(j, slots, hidden, first, count, token_rows))
        index = device_tensor(slots, out.hidden.device)
        for j, run in enumerate(runs[:-1]):
            keep = (run.count > 0)[:, None]
            self.carry[index, j] = torch.where(keep, run.last(), self.carry[index, j])
        return runs

    def _chained_input(self, prev, slots, j, first):
        """Layer j-1's outputs at layer j's positions: the carried one at first == prev.first - 1."""
        dev = prev.out.device
        with_carry = torch.cat([self.carry[device_tensor(slots, dev), j - 1][:, None], prev.out], 1)
        return shift_rows(with_carry, 1 + device_tensor(first, dev) - prev.first)[:, :prev.out.shape[1]]

    def _run_layer(self, j, slots, hidden, first, count, token_rows):
        dev = hidden.device
        first_t, count_t = device_tensor(first, dev), device_tensor(count, dev)
        width = max(count)
        if width == 0:  # nothing true yet (a prompt shorter than j + 2 tokens)
            return LayerRun(hidden, first_t, count_t)
        out = self.steps.run(f"catch-up{j}", j, slots, first, count, token_rows(j, first, count), hidden[:, :width])
        return LayerRun(out, first_t, count_t)

    # ---- drafting ------------------------------------------------------------------
    def deeper_layer_step(self, j, slots, last_pos, true_prev, speculative_prev, drafts):
        """Layer j over positions e-j+1..e (tokens: drafts 1..j). Returns its outputs there
        [B, j, H], right-aligned (index j-1 is position e)."""
        hidden = torch.cat([true_prev[:, None], speculative_prev], 1)
        # positions below 0 (very short prompts) do not exist: drop them, left-aligning the rest
        drop = [max(j - 1 - p, 0) for p in last_pos]
        width = j - min(drop)
        drop_t = device_tensor(drop, hidden.device)
        out = self.steps.run(f"deeper{j}", j, slots, [p - j + 1 + d for p, d in zip(last_pos, drop)],
                             [j - d for d in drop], shift_rows(drafts, drop_t)[:, :width],
                             shift_rows(hidden, drop_t)[:, :width])
        return shift_rows(torch.nn.functional.pad(out, (0, 0, 0, j - width)), -drop_t)

    def reuse_step(self, layer, slots, tokens, hidden, positions):
        """One speculative step of `layer` at `positions` (host ints) on (its previous output, previous draft)."""
        out = self.steps.run("reuse", layer, slots, positions, [1] * len(slots), tokens[:, None],
                             hidden[:, None])
        return out[:, 0]
