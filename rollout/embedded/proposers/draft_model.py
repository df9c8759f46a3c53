"""Draft-model proposer: a separate small HF checkpoint (same vocabulary) drafts k tokens
autoregressively with its own slot KV cache.

Per request we remember where the last drafting started (`base`) and what it drafted.
Draft-cache entries at positions < base are true tokens; drafts 1..k-1 were written at
base..base+k-2, so after verification the cache stays valid up to base + (number of those
drafts that were accepted). Each propose feeds the remaining true tokens in one ragged
forward (at least the newest token, whose logits give draft 1), then k-1 one-token steps.
"""
import torch

from vime.models.hf_format import load_hf_checkpoint
from rollout.embedded.model import CausalLMWithMTP
from rollout.embedded.moe import MoE
from rollout.embedded.proposers import Proposer
from rollout.embedded.steps import device_tensor
from rollout.embedded.proposers.drafting import DraftSteps, assign_drafts, draft_cache, pick_drafts, uniforms_if_sampling
from vime.spec_config import check_draft_vocab


def load_draft_model(path, dtype, device):
    cfg, state, _ = load_hf_checkpoint(path)
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device, dtype).eval().requires_grad_(False)


def valid_prefix(base, drafted, ids):
    """Draft-cache entries still valid: those before base plus accepted written drafts."""
    written = drafted[:-1]  # the last draft is never fed back
    a = 0
    while a < len(written) and base + a < len(ids) and ids[base + a] == written[a]:
        a += 1
    return base + a


class DraftModelProposer(Proposer):
    """Drafts with a separate small causal LM that shares the target's vocabulary (its own KV cache)."""

    def __init__(self, spec, model=None, sample_drafts=False):
        self.spec, self.model, self.sample_drafts = spec, model, sample_drafts  # see drafting.py
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.state = {}  # id(request) -> (base, drafted tokens)

    def attach(self, engine):
        self.engine = engine
        if self.model is None:
            self.model = load_draft_model(self.spec.model, engine.config.dtype, engine.config.device)
        cfg = self.model.cfg
        check_draft_vocab(self.spec.model, cfg.vocab_size, engine.cfg.vocab_size)
        self.cache = draft_cache(engine, cfg.num_hidden_layers, cfg, self.num_speculative_tokens)
        # a mixture-of-experts draft dispatches experts by the routing's data: its steps run eagerly
        dense = not any(isinstance(layer.mlp, MoE) for layer in self.model.model.layers)
        self.steps = DraftSteps(engine, self.cache, self._logits, graphable=dense, rotary=self.model.rotary)

    def propose(self, out):
        reqs, k = out.requests, self.num_speculative_tokens
        sampling = reqs[0].sampling
        uniforms = uniforms_if_sampling(self.spec, reqs, k, self.sample_drafts)
        device = out.hidden.device
        ids = [r.all_ids for r in reqs]
        starts = [min(self._valid(r, x), len(x) - 1) for r, x in zip(reqs, ids)]
        slots = [r.slot for r in reqs]
        n_new = [len(x) - v for x, v in zip(ids, starts)]
        logits = self.steps.run("catch-up", 0, slots, starts, n_new, [x[v:] for x, v in zip(ids, starts)])
        logits = logits[torch.arange(len(reqs), device=device), device_tensor(n_new, device) - 1]
        pos = [s + n for s, n in zip(starts, n_new)]
        tokens, probs = [], []
        for i in range(k):
            tok, q = pick_drafts(logits, sampling, None if uniforms is None else uniforms[:, i])
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                logits = self.steps.run("step", 0, slots, [p + i for p in pos], [1] * len(reqs), tok[:, None])[:, 0]
        drafts = torch.stack(tokens, 1)
        assign_drafts(reqs, drafts, torch.stack(probs, 1) if uniforms is not None else None)
        for r, x, row in zip(reqs, ids, drafts.tolist()):
            self.state[id(r)] = (len(x), row)

    def _valid(self, r, ids):
        if id(r) not in self.state:
            return 0
        base, drafted = self.state[id(r)]
        return valid_prefix(base, drafted, ids)

    def _logits(self, j, tokens, hidden, positions, view):
        """The draft model's logits of its step's tokens, writing their keys/values into its cache."""
        return self.model.logits(self.model(tokens, positions, view.layers(self.model.cfg.num_hidden_layers)))

    def release(self, request):
        self.state.pop(id(request), None)

    def move_slots(self, requests, old_slots):
        length = max(r.num_tokens for r in requests) + self.num_speculative_tokens
        self.cache.move_slots(old_slots, [r.slot for r in requests], length)
