"""DSpark proposer: a DFlash block forward, then the Markov head left to right, verification sized by confidence.

It drafts as vLLM's DSpark speculator does (v1/worker/gpu/spec_decode/dspark/speculator.py). The
context is DFlash's (proposers/dflash.py: each verified position's target states, through the
draft's fc and each layer's keys and values, into the draft's own KV cache). The block is the
newest token followed by noise tokens, one forward; slot i's base logits are the draft of the token
after it. The drafts are then drawn left to right: slot i's logits are its base logits plus the
Markov bias of the token drawn at slot i-1 (the newest token before slot 0), argmax or sampled
from q_i = the processed distribution of those logits, which is the draft's conditional given the
drafts before it: exactly what the rejection sampler needs, so verification stays exact.

Confidence-sized verification (vLLM's `enable_adaptive_verification`): the confidence head's
per-slot acceptance probabilities go to the engine's k policy (`spec_policy.ConfidenceSizedK`), whose
`sized_q` says how many drafts each row verifies. Under a k policy that does not size steps
(`sizes_verification` false: a fixed k, a schedule, AdaptiveK) the confidence head is not run.

Unlike DFlash, a step with no drafts (the k policy's k = 0) costs nothing here beyond keeping the
new positions' target states: the context write is deferred to the next drafting step, which
writes every position since the last one in its one context forward, so a schedule that stops
drafting falls back to plain decoding's cost. A generate whose k policy drafts at none of its steps
(`drafts_this_generate`) keeps no states either: no catch-up can come in it.
"""
import torch

from mtp.dspark import acceptance_confidence, draft_left_to_right
from rollout.embedded.proposers import Proposer
from rollout.embedded.proposers.dflash import DFlashProposer
from rollout.embedded.proposers.drafting import assign_drafts, pick_drafts, uniforms_if_sampling
from rollout.embedded.steps import device_tensor
from vime.models.dspark import DSPARK


class DSparkProposer(DFlashProposer):
    """Drafts a block per request with an external DSpark draft: one block forward, the Markov head
    left to right, and as many drafts verified as the confidence head makes worth it."""

    kind = DSPARK
    costs_at_k0 = False  # a step without drafts defers the context write: it costs what plain decoding does

    def attach(self, engine):
        super().attach(engine)
        self.written = [0] * engine.config.max_batch_size  # context positions written, per slot
        self.kept = None  # [rows, positions, aux width]: target states of positions not yet in the context
        # slot -> its row of `kept` (a permutation): a slot move swaps two entries and copies no state
        self.kept_rows = list(range(engine.config.max_batch_size))

    def release(self, request):
        self.written[request.slot] = 0

    def move_slots(self, requests, old_slots):
        """Move what each slot holds: the draft cache's context, only below the positions written into it
        (nothing in a generate that never drafted); the kept states by swapping rows. Why: the engine
        compacts slots as rows finish, and copying whole kept rows and caches at every move would make a
        generate that drafts nothing dearer than plain decoding."""
        new = [r.slot for r in requests]
        written = [self.written[s] for s in old_slots]
        if max(written):
            self.cache.move_slots(old_slots, new, max(written))
        for old in old_slots:  # the slots left behind are free
            self.written[old] = 0
        for old, slot, w in zip(old_slots, new, written):
            self.written[slot] = w
            # the new slot was free (a hole below the batch's size) and the old one is now: a swap keeps a permutation
            self.kept_rows[slot], self.kept_rows[old] = self.kept_rows[old], self.kept_rows[slot]

    # ---- drafting ----
    def propose(self, out):
        reqs = out.requests
        slots = [r.slot for r in reqs]
        starts, n_valid = out.host_lengths()
        k = min(self.num_speculative_tokens, self.engine.step_k)
        if k == 0:
            if self.engine.may_draft:  # a generate that drafts at no step never catches up: nothing to keep
                self.keep_states(slots, out.hidden, starts)
            return Proposer.propose(self, out)
        self.catch_up(slots, out.hidden, starts, n_valid)
        anchor_tokens = [r.all_ids[-1] for r in reqs]
        logits, states = self.block_forward(slots, anchor_tokens, [s + v for s, v in zip(starts, n_valid)],
                                            with_states=True)
        draft, base, states = self.draft_model, logits[:, :k], states[:, :k]  # slot i: the token after it
        uniforms = uniforms_if_sampling(self.spec, reqs, k, self.sample_drafts)
        tokens, q, embeds = draft_left_to_right(
            draft, base, device_tensor(anchor_tokens, base.device),
            lambda i, x: pick_drafts(x, reqs[0].sampling, None if uniforms is None else uniforms[:, i]))
        sizes = self.verification_size(len(reqs), self.confidence(states, embeds), k)
        assign_drafts(reqs, tokens, q)
        for r, size in zip(reqs, sizes):
            r.drafts = r.drafts[:size]
            r.draft_probs = None if r.draft_probs is None else r.draft_probs[:size]

    def confidence(self, states, embeds):
        """[B, k] the drafts' predicted acceptance, where the k policy sizes steps by it (else None: a head
        nothing reads is not run; at one row it was a tenth of DSpark's drafting beyond DFlash's)."""
        if not self.engine.k_policy.sizes_verification:
            return None
        return acceptance_confidence(self.draft_model, states, embeds)

    def verification_size(self, batch_size, confidence, k):
        """[B] drafts each row verifies this step: the k policy's choice from the drafts' confidences, all k
        without a head or a sizing policy."""
        size = None if confidence is None else self.engine.k_policy.verification_size(batch_size, confidence)
        size = k if size is None else size
        return [size] * batch_size if isinstance(size, int) else [int(x) for x in size]

    # ---- the context, deferred over steps without drafts ----
    def keep_states(self, slots, hidden, starts):
        """Keep a target forward's states [n, Q, W] (rows at slots, from starts: host ints) until a
        drafting step writes them into the context."""
        if self.kept is None:  # made at the first step without drafts: a schedule that always drafts needs none
            ec = self.engine.config
            with torch.inference_mode(False):  # a normal tensor: slot moves update it outside inference mode
                self.kept = torch.empty(ec.max_batch_size, self.cache.max_len, hidden.shape[-1], dtype=ec.dtype,
                                        device=ec.device)
        # every position of the forward, the unverified ones too: one copy, no masking; those hold
        # garbage until the step that verifies them writes them, always before a catch-up reads them
        dev = self.kept.device
        positions = device_tensor(starts, dev)[:, None] + torch.arange(hidden.shape[1], device=dev)[None, :]
        self.kept[self.rows_of(slots)[:, None], positions.clamp(max=self.kept.shape[1] - 1)] = hidden

    def rows_of(self, slots):
        """The kept rows of `slots` (host ints), as a device tensor."""
        return device_tensor([self.kept_rows[s] for s in slots], self.kept.device)

    def catch_up(self, slots, hidden, starts, n_valid):
        """Write the context of every position since each row's last drafting step: this forward's
        states, and the kept states of the steps between, in one context forward."""
        first = [self.written[s] for s in slots]
        end = [s + v for s, v in zip(starts, n_valid)]
        if first == list(starts):  # nothing deferred: this forward's states are the whole catch-up
            self.write_context(slots, hidden, starts, n_valid)
        else:
            self.keep_states(slots, hidden, starts)
            dev, width = self.kept.device, max(e - f for e, f in zip(end, first))
            at = device_tensor(first, dev)[:, None] + torch.arange(width, device=dev)[None, :]
            self.write_context(slots, self.kept[self.rows_of(slots)[:, None], at.clamp(max=self.kept.shape[1] - 1)],
                               first, [e - f for e, f in zip(end, first)])
        for slot, e in zip(slots, end):
            self.written[slot] = e

    def profile_draft(self, batch_size, k, new_tokens=2):
        """One drafting for batch_size rows (context for `new_tokens` verified positions, the block
        forward, k Markov steps and the confidence where it is read) on dummy inputs in slots 0..batch_size-1."""
        with torch.inference_mode():
            slots, anchors = self.profile_context(batch_size, new_tokens)
            logits, states = self.block_forward(slots, [0] * batch_size, anchors, with_states=True)
            tokens = torch.zeros(batch_size, dtype=torch.long, device=logits.device)
            _, _, embeds = draft_left_to_right(self.draft_model, logits[:, :k], tokens,
                                               lambda i, x: pick_drafts(x, None))
            self.confidence(states[:, :k], embeds)
