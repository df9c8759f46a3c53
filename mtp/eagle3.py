"""The EAGLE-3 draft (pure torch), written as vLLM's `LlamaForCausalLMEagle3` computes it.

Parameter names equal the checkpoint names vLLM loads (`fc`, `midlayer.*`, `norm`, `lm_head`),
so a state dict saved from this module is a servable draft. The draft owns no embedding: it
reads the target's (vLLM shares the target's `embed_tokens` with a draft that stores none).

At position t the draft reads the embedding of token t+1 and a hidden state h_t: from the
target, h_t = fc(cat(aux hidden states of three target layers at t)); from itself (a drafting
step past the last true position), its own pre-norm output at t-1. One decoder layer runs
attention over cat(input_layernorm(embedding), hidden_norm(h_t)) (width 2H) with h_t as the
residual; the final norm of the residual stream gives the logits through `lm_head`, and the
residual stream itself is what the next step reads (vLLM's `aux_output`).

A draft may predict only part of the target's vocabulary (`draft_vocab_size` < `vocab_size`, EAGLE-3's
reduced draft vocabulary): its head then has one row per draft id, and two fixed tables say which
target tokens those are, under the names vLLM loads: `d2t` (target id = draft id + d2t[draft id]) and
`t2d` (the target ids the draft has). `logits` scatters the head's logits onto the whole vocabulary,
-inf elsewhere, as vLLM's `compute_logits` does, so a proposer and exact verification see a q that is
0 outside the draft's vocabulary; training projects onto the draft's own vocabulary only.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mtp.blocks import DraftAttention, DraftShape, Norm, SwiGLU, causal_attention
from mtp.loss import MTP_LOSSES, in_draft_vocabulary


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(DraftShape):
    """The draft's architecture (the fields of its config.json that shape the tensors)."""

    aux_layer_ids: tuple  # the target layers whose hidden states fc reads (vLLM's numbering)
    draft_vocab_size: Optional[int] = None  # the target tokens its head predicts (None: all of vocab_size)

    @property
    def head_size(self):
        """The rows of the draft's head: its vocabulary's size."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def reduced_vocab(self):
        """True when the draft predicts only part of the target's vocabulary (it holds d2t and t2d)."""
        return self.head_size < self.vocab_size


class Eagle3Attention(DraftAttention):
    """Grouped-query attention whose q/k/v read the concatenated 2H input (no q/k norm)."""

    def __init__(self, cfg):
        super().__init__(cfg, 2 * cfg.hidden_size)

    def qkv(self, x, positions):
        """x [B, Q, 2H] -> rotated q [B, heads, Q, D], rotated k and v [B, kv_heads, Q, D]."""
        return (self.query(x, positions), *self.key_value(x, positions))

    def forward(self, x, positions, cache=None):
        """x [B, Q, 2H]; `cache` is a KV view with `attend(q, k, v, positions)` or None."""
        q, k, v = self.qkv(x, positions)
        out = causal_attention(q, k, v, positions) if cache is None else cache.attend(q, k, v, positions)
        return self.output(out)


class Eagle3MidLayer(nn.Module):
    """The draft's one decoder layer (vLLM's eagle3 `LlamaDecoderLayer` with layer_idx 0)."""

    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = Norm(h, eps)
        self.hidden_norm = Norm(h, eps)
        self.post_attention_layernorm = Norm(h, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = SwiGLU(cfg)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft: `forward` gives the residual stream (fed back), `logits` the next-token logits."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(cfg)
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.head_size, bias=False)
        if cfg.reduced_vocab:
            # fixed by the format, never trained: buffers, saved with the weights (vLLM loads d2t, skips t2d)
            self.register_buffer("d2t", torch.zeros(cfg.head_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
            self.set_vocabulary(torch.arange(cfg.head_size))

    def set_vocabulary(self, target_ids):
        """Predict the target tokens `target_ids` [draft_vocab_size] (distinct): draft id i is target_ids[i]."""
        target_ids = target_ids.to(self.d2t.device)
        with torch.no_grad():
            self.d2t.copy_(target_ids - torch.arange(len(target_ids), device=target_ids.device))
            self.t2d.zero_()
            self.t2d[target_ids] = True

    def target_ids(self):
        """[head_size] the target id of each row of the head (all of them, in order, for a full vocabulary)."""
        rows = torch.arange(self.cfg.head_size, device=self.lm_head.weight.device)
        return rows + self.d2t if self.cfg.reduced_vocab else rows

    def combine(self, aux_hidden):
        """[.., 3 * target H] concatenated aux hidden states -> the draft's hidden input [.., H]."""
        return self.fc(aux_hidden)

    def layer_input(self, embeds, hidden):
        m = self.midlayer
        return torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], -1)

    def after_attention(self, attn_out, hidden):
        """The residual stream after the layer, given the attention output and h_t (the residual)."""
        m = self.midlayer
        residual = attn_out + hidden
        return m.mlp(m.post_attention_layernorm(residual)) + residual

    def forward(self, embeds, hidden, positions, cache=None):
        """embeds: the target's embedding of token t+1; hidden: h_t (combined or fed back) [B, Q, H];
        returns the residual stream at t [B, Q, H] (what the next step reads)."""
        attn = self.midlayer.self_attn(self.layer_input(embeds, hidden), positions, cache)
        return self.after_attention(attn, hidden)

    def draft_logits(self, stream):
        """Next-token logits over the draft's own vocabulary [.., head_size] (final norm, then its head)."""
        return self.lm_head(self.norm(stream))

    def logits(self, stream):
        """Next-token logits over the target's whole vocabulary [.., vocab_size]: the draft's own, and -inf
        at the target tokens a reduced vocabulary leaves out (q = 0 there)."""
        logits = self.draft_logits(stream)
        if not self.cfg.reduced_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return full.index_copy(-1, self.target_ids(), logits)


def training_time_test(draft, embeds, aux_hidden, steps):
    """EAGLE-3's training-time test: the draft unrolled on its own outputs for `steps` steps,
    every position a drafting point at once, attending as the drafter does.

    embeds [B, T, H]: the target's embedding of tokens 0..T-1; aux_hidden [B, T, 3H]: the target's
    aux hidden states at positions 0..T-1 (both detached). Step m's entry t sits at position t+m,
    reads token t+m+1 and (m >= 1) step m-1's output at entry t, attends over step 0's entries at
    positions <= t and its own chain (entry t of steps 1..m, what the drafter's speculative cache
    entries hold), and predicts token t+m+2. Returns one [B, T-1, N] logits tensor per step over the
    draft's own vocabulary (N = its head's rows; entry t; entries whose target lies past T are garbage
    for the caller to mask)."""
    b, n, _ = embeds.shape
    s = n - 1
    t = torch.arange(s, device=embeds.device)
    attn = draft.midlayer.self_attn
    hidden = draft.combine(aux_hidden[:, :s])
    keys, values, logits = [], [], []
    base = t[None, :] <= t[:, None]  # step 0's entries at positions <= t
    own = torch.eye(s, dtype=torch.bool, device=t.device)  # entry t of steps 1..m
    for m in range(steps):
        step_embeds = embeds[:, (t + m + 1).clamp(max=n - 1)]
        positions = (t + m).expand(b, s)
        q, k, v = attn.qkv(draft.layer_input(step_embeds, hidden), positions)
        keys.append(k)
        values.append(v)
        mask = torch.cat([base] + [own] * m, 1)
        out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                             enable_gqa=q.shape[1] != k.shape[1])
        hidden = draft.after_attention(attn.output(out), hidden)
        logits.append(draft.draft_logits(hidden))  # the draft's vocabulary only: what its loss reads
    return logits


def training_time_test_loss(draft, embeds, aux_hidden, tokens, loss_mask, steps, loss_type="ce", policy_logits=None,
                            temperature=1.0, topk=0):
    """Mean loss of each step's prediction (token t+m+2) over the positions where `loss_mask`
    [B, T] marks the predicted token; returns (total loss, per-step losses).

    `loss_type` names a per-position loss of mtp/loss.py's `MTP_LOSSES`: `ce` against the sampled
    token, or a distillation loss (`soft_ce`, `tv`) against the policy's own distribution of that
    token, read from `policy_logits` [B, T, V] (its next-token logits at position t+m+1, detached)
    at `temperature`, truncated to its top-k when `topk` > 0. A draft of a reduced vocabulary is
    trained in it (mtp/loss.py `in_draft_vocabulary`)."""
    n = tokens.shape[1]
    vocabulary = draft.target_ids() if draft.cfg.reduced_vocab else None
    per_step = []
    for m, logits in enumerate(training_time_test(draft, embeds, aux_hidden, steps)):
        width = n - m - 2  # entries whose target t+m+2 exists
        if width <= 0:
            break
        target = tokens[:, m + 2:]
        mask = loss_mask[:, m + 2:].float()
        policy = policy_logits[:, m + 1:m + 1 + width] if policy_logits is not None else None
        if vocabulary is not None:
            target, mask, policy = in_draft_vocabulary(vocabulary, draft.cfg.vocab_size, loss_type, target, mask,
                                                       policy)
        per_position = MTP_LOSSES[loss_type](logits[:, :width].float(), target,  # fp32 under bf16 too
                                                policy.float() if policy is not None else None, temperature, topk)
        per_step.append((per_position * mask).sum() / mask.sum().clamp(min=1))
    return sum(per_step) / max(len(per_step), 1), per_step


def frequent_vocabulary(tokens, size, vocab_size):
    """The `size` target ids most frequent in `tokens` (ties: the lower id; too few distinct tokens: the
    lowest unused ids), ascending: a reduced draft vocabulary."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size)
    # a stable sort keeps equal counts in id order, so ties and unseen ids go to the lower id
    return torch.sort(counts, descending=True, stable=True).indices[:size].sort().values
