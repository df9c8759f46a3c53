"""Helpers the model-based proposers share: picking draft tokens from draft logits, their draft
forwards as static steps (`DraftSteps`), and what every external draft's proposer has in common
(`ExternalDraft`).

A draft is either deterministic (argmax; the verifier then treats q as one-hot, which is
exact for any deterministic proposer) or sampled from q = the draft's distribution
processed exactly like the target's (temperature, top-k, top-p), in which case q is
returned so probabilistic verification can use min(1, p/q).

Default: argmax drafts with q = None, as vLLM's MTP/EAGLE proposers do. Sampled drafts
are accepted with probability sum_x min(p, q) = 1 - TV(p, q), argmax drafts with p(argmax q).
`sample_drafts=True` switches to sampled drafts; it only applies with `probabilistic` verification (strict ignores q).
"""
import dataclasses
import itertools

import torch

from mtp.sampling import processed_logprobs, sample_with_uniforms
from rollout.embedded.kv_cache import make_kv_cache
from rollout.embedded.linear import pack_linears, pick_backend

DRAFT_FAMILY = "draft"  # every proposer step family starts so (the engine drops them with the proposer)
# a draft's cache is read by the masked attention: flash-attn's in-kernel cache write would need room
# for a whole query window past the scratch position, and a catch-up's window has no fixed bound
DRAFT_ATTENTION = "sdpa"


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
        # the engine's GEMMs (oneDNN's packed weights on CPU): a draft's step streams its weights as a trunk's does
        pack_linears(self.draft_model, pick_backend(ec.device, ec.dtype))
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
        # parameters only, as the trainer sends (trainer/drafts/external.py): buffers are fixed by the format
        return {self.kind.wire_prefix + name: p for name, p in self.draft_model.named_parameters()}

    def named_draft_weights(self):
        # counted once a sync wrote the draft: only a trained draft has a trainer-side twin
        return list(self.loadable_draft_weights().items()) if self.synced else []

    def draft_synced(self):
        self.synced = True


_families = itertools.count()


def draft_family():
    """A step family name of its own for one proposer's caches: their graphs are never another's."""
    return f"{DRAFT_FAMILY}{next(_families)}"


class DraftSteps:
    """A proposer's draft forwards as static steps (rollout/embedded/steps.py) on its own cache:
    `run` lays ragged rows out on the engine's step runner and runs
    forward(j, tokens, hidden, positions, step_view) there — as a CUDA graph where the engine
    captures its steps and `graphable` allows (a dense draft network: the layers of a mixture-of-
    experts model dispatch experts by the routing's data and run eagerly)."""

    def __init__(self, engine, cache, forward, graphable=True, rotary=None):
        self.engine, self.cache, self.forward, self.graphable = engine, cache, forward, graphable
        self.family = draft_family()
        # padding rows sit past every real position: keep them inside the rotary table
        self.max_position = (rotary or engine.model.rotary).cos.shape[0] - 1

    def run(self, name, j, slots, starts, counts, tokens, hidden=None):
        """Draft network part j over rows in `slots` writing counts[b] positions from starts[b]
        (host ints); tokens: host lists or [n, W]; hidden: [n, W, H] or None -> the forward's
        output for the n rows. `name` keeps apart the step kinds whose outputs are alive together
        (one shared output buffer per name)."""
        layout = self.engine.steps.layout(self.cache, slots, starts, counts, self.graphable)
        shape = layout.shape
        tokens = layout.tokens(tokens) if isinstance(tokens, list) else layout.pad(tokens, shape.q_len)
        inputs = (tokens, layout.slots, layout.starts) + (() if hidden is None else (layout.pad(hidden, shape.q_len),))
        (out,) = self.engine.steps.run((f"{self.family}/{name}", shape, j), self.step(j, shape), inputs,
                                       layout.graphed)
        return out[:layout.n]

    def step(self, j, shape):
        """Part j's step function at `shape`: (tokens, slots, starts[, hidden]) -> (out,)."""
        def step(tokens, slots, starts, hidden=None):
            positions = shape.positions(starts).clamp(max=self.max_position)
            view = self.cache.static_step(slots, starts, shape, DRAFT_ATTENTION)
            return (self.forward(j, tokens, hidden, positions, view),)
        return step


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
