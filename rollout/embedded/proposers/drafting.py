"""Helpers the model-based proposers share: picking draft tokens from draft logits, and what every
external draft's proposer has in common (`ExternalDraft`).

A draft is either deterministic (argmax; the verifier then treats q as one-hot, which is
exact for any deterministic proposer) or sampled from q = the draft's distribution
processed exactly like the target's (temperature, top-k, top-p), in which case q is
returned so probabilistic verification can use min(1, p/q).

Default: argmax drafts with q = None, as vLLM's MTP/EAGLE proposers do. Sampled drafts
are accepted with probability sum_x min(p, q) = 1 - TV(p, q), argmax drafts with p(argmax q);
on the tiny model at temperature 1 the MTP head is flatter than the target and argmax wins
(0.33 vs 0.25 acceptance, see BENCHMARKS.md). `sample_drafts=True` switches to sampled
drafts; it only applies with `probabilistic` verification (strict ignores q).
"""
import dataclasses

import torch

from mtp.sampling import processed_logprobs, sample_with_uniforms
from rollout.embedded.kv_cache import make_kv_cache


class ExternalDraft:
    """What every external draft's proposer shares: the draft module of its kind (`kind`, a DraftKind),
    loaded from the speculative config's `model` and checked against the target unless given; its
    own KV cache; and the weight-sync hooks of a draft the trainer trains (its parameters travel
    under the kind's wire prefix, and count as synced once a sync wrote them)."""

    kind = None  # the DraftKind (vime/models/draft_kinds.py)
    synced = False

    def attach(self, engine):
        """Load (or check, when given) the draft for the engine's target; build its KV cache."""
        self.engine, ec, k = engine, engine.config, self.num_speculative_tokens
        if self.draft_model is None:
            self.draft_model = self.kind.load_for_target(self.spec.model, engine.cfg, k)
        else:
            shapes = {name: tuple(t.shape) for name, t in self.draft_model.state_dict().items()}
            self.kind.check_fits("(in memory)", self.draft_model.cfg, engine.cfg, k, tensors=shapes)
        self.draft_model = self.draft_model.to(ec.device, ec.dtype).eval().requires_grad_(False)
        cfg = self.draft_model.cfg
        self.aux_hidden_layers = tuple(cfg.aux_layer_ids)
        # the draft's attention is grouped-query attention of its own, whatever the target's (MLA too)
        shape = dataclasses.replace(engine.cfg, num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                    mla=None)
        self.cache = draft_cache(engine, self.draft_layers(), shape, k)

    def draft_layers(self):
        """How many layers of the draft keep a KV cache."""
        return self.draft_model.cfg.num_hidden_layers

    def loadable_draft_weights(self):
        return {self.kind.wire_prefix + name: p for name, p in self.draft_model.named_parameters()}

    def named_draft_weights(self):
        # counted once a sync wrote the draft: only a trained draft has a trainer-side twin
        return list(self.loadable_draft_weights().items()) if self.synced else []

    def draft_synced(self):
        self.synced = True


def samples_drafts(spec, sampling, enabled):
    return enabled and spec.rejection_sample_method == "probabilistic" and not sampling.greedy


def draft_uniforms(reqs, k):
    """[B, k] uniforms from each request's own generator (batch-independent draws)."""
    return torch.stack([r.uniforms(k) for r in reqs])


def uniforms_if_sampling(spec, reqs, k, sample_drafts):
    """Draft uniforms when this step samples its drafts from q, else None (argmax drafts)."""
    return draft_uniforms(reqs, k) if samples_drafts(spec, reqs[0].sampling, sample_drafts) else None


def draft_cache(engine, num_layers, model_cfg, num_speculative_tokens):
    """A proposer's own KV cache: one slot per engine slot, room for the drafts past the context."""
    ec = engine.config
    return make_kv_cache(model_cfg, num_layers, ec.max_batch_size, engine.max_len + num_speculative_tokens + 2,
                         ec.dtype, ec.device)


def pick_drafts(logits, sampling, uniforms=None):
    """logits [B, V] -> (tokens [B], q [B, V] or None). uniforms [B] means: sample from q."""
    if uniforms is None:
        return logits.argmax(-1), None
    q = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p).exp()
    return sample_with_uniforms(q, uniforms.to(q.device)), q


def assign_drafts(reqs, tokens, probs):
    """tokens [B, k] (and probs [B, k, V] or None) -> request.drafts / request.draft_probs."""
    rows = tokens.tolist()
    for i, r in enumerate(reqs):
        r.drafts = rows[i]
        r.draft_probs = probs[i] if probs is not None else None
