"""The DFlash draft (pure torch), written as vLLM's `DFlashDraftModel` (qwen3_dflash.py) computes it.

DFlash is a block-diffusion draft: it proposes a whole block of tokens in ONE forward.

Context. At every position p whose token the target has verified, the draft reads the target's
hidden states after the layers `target_layer_ids` (concatenated in layer order), projects them
with `fc` and normalises them with `hidden_norm`: c_p = hidden_norm(fc(aux_p)). Each draft layer
turns c_p into a key and a value of its own (its k_proj, k_norm, rotary at p; its v_proj); these
are the draft's KV cache. Context states never pass through the layers' queries or MLPs.

Block. With n tokens known, the block sits at positions n-1 .. n-1+k: the newest token x_{n-1}
(whose target hidden state does not exist yet: the anchor) followed by k copies of
`mask_token_id`, embedded with the target's embedding. The block runs through the draft's
Qwen3-style decoder layers (pre-norm, per-head q/k RMSNorm, neox rotary, SwiGLU); each query
attends to every context key at positions < n-1 and to every key of the block, in both
directions (attention is not causal inside the block). The final norm and the target's head
give logits at every block position; the logits at position n-1+i are the draft of token
n-1+i (i = 1..k): a block slot predicts its own token, not the next one.

The draft stores no embedding and no head: vLLM shares the target's with a draft that stores
none, so a draft trained against a moving policy reads the policy's as they are.

Training (the paper's objective, `block_loss`): blocks anchored at random positions of the
responses, the anchor token clean and the rest masked, the context being the target's states
before the anchor, cross-entropy of each masked slot against the true token, weighted by
exp(-(i-1)/gamma) for slot i so that the early slots, which decide acceptance, weigh most.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtp.blocks import DraftAttention, DraftShape, Norm, SwiGLU
from mtp.loss import MTP_LOSSES


@dataclass(frozen=True, kw_only=True)
class DFlashConfig(DraftShape):
    """The draft's architecture (the fields of its config.json that shape the tensors and the block)."""

    num_hidden_layers: int
    target_layer_ids: tuple  # target layers whose OUTPUT fc reads (DFlash's numbering: 0 = first layer)
    mask_token_id: int
    block_size: int  # anchor + drafts: the draft proposes block_size - 1 tokens

    @property
    def aux_layer_ids(self):
        """The same layers in vLLM's aux-hidden-state numbering (id i: after i layers), as the engine reads them."""
        return tuple(t + 1 for t in self.target_layer_ids)

    @property
    def num_drafts(self):
        return self.block_size - 1


class DFlashAttention(DraftAttention):
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3), keys from the context and the block."""

    def __init__(self, cfg):
        super().__init__(cfg, cfg.hidden_size, qk_norm=True)

    def forward(self, x, positions, context_k, context_v, mask):
        """Queries of the block x [B, Q, H] over keys cat(context [B, kv, T, D], block): mask [B, Q, T + Q]."""
        q = self.query(x, positions)
        k, v = self.key_value(x, positions)
        keys, values = torch.cat([context_k, k], 2), torch.cat([context_v, v], 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None],
                                             enable_gqa=q.shape[1] != keys.shape[1])
        return self.output(out)


class DFlashLayer(nn.Module):
    """One pre-norm decoder layer of the draft (vLLM's DFlashQwen3DecoderLayer)."""

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, positions, context_k, context_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, context_k, context_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The DFlash draft: `context` and `context_kv` build its cache, `forward` runs a block,
    `logits` reads it through the target's head."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)

    def context(self, aux_hidden):
        """[.., n_layers * target H] concatenated target states -> the context states [.., H]."""
        return self.hidden_norm(self.fc(aux_hidden))

    def context_kv(self, context, positions):
        """One (keys, values) [B, kv, T, D] per layer for context states [B, T, H] at positions [B, T]."""
        return [layer.self_attn.key_value(context, positions) for layer in self.layers]

    def forward(self, embeds, positions, kv, mask):
        """The block embeds [B, Q, H] at positions [B, Q] over the per-layer context `kv`,
        visibility `mask` [B, Q, T + Q]; returns the final-normed states [B, Q, H]."""
        x = embeds
        for layer, (k, v) in zip(self.layers, kv):
            x = layer(x, positions, k, v, mask)
        return self.norm(x)

    def block_input(self, anchor_tokens, embed_weight):
        """[B] anchor tokens -> the block's embeddings [B, block_size, H]: the anchor, then mask tokens."""
        tokens = torch.full((anchor_tokens.shape[0], self.cfg.block_size), self.cfg.mask_token_id,
                            dtype=torch.long, device=anchor_tokens.device)
        tokens[:, 0] = anchor_tokens
        return F.embedding(tokens, embed_weight)

    @staticmethod
    def logits(states, head_weight):
        return F.linear(states, head_weight)


# ---------------------------------------------------------------- training: the block objective
def block_visibility(anchors, keep, seq_len, block_size):
    """[B, N*S, T + N*S] keys each packed block slot sees: context positions before its anchor
    and every slot of its own block (none for blocks that `keep` [B, N] drops, except context 0
    so that no softmax row is empty)."""
    device = anchors.device
    n = anchors.shape[1]
    slot_block = torch.arange(n * block_size, device=device) // block_size
    anchor_of_slot = anchors[:, slot_block]  # [B, Q]
    context = torch.arange(seq_len, device=device)[None, None, :] < anchor_of_slot[:, :, None]
    same_block = (slot_block[:, None] == slot_block[None, :]).expand(anchors.shape[0], -1, -1)
    visible = torch.cat([context, same_block], 2)
    dropped = ~keep[:, slot_block]
    visible[:, :, 0] |= dropped
    return visible


def sample_anchors(loss_mask, num_anchors, generator=None):
    """Up to `num_anchors` distinct anchors per row [B, N] and which are real [B, N]: positions
    a >= 1 whose next token is one to learn (loss_mask[a + 1]), as inference anchors are the
    newest verified token of a response."""
    b, t = loss_mask.shape
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, 1:t - 1] = loss_mask[:, 2:] > 0
    counts = candidates.sum(1)
    n = max(1, min(num_anchors, int(counts.max())))
    anchors = torch.zeros(b, n, dtype=torch.long, device=loss_mask.device)
    keep = torch.zeros(b, n, dtype=torch.bool, device=loss_mask.device)
    for i in range(b):
        where = candidates[i].nonzero().flatten()
        if where.numel() == 0:
            continue
        chosen = where[torch.randperm(where.numel(), generator=generator)[:n].to(where.device)].sort().values
        anchors[i, :chosen.numel()] = chosen
        keep[i, :chosen.numel()] = True
    return anchors, keep


def position_weights(block_size, gamma, device=None, first=1):
    """[S] loss weight of each block slot: 0 before the first slot that predicts (`first`: 1 for
    DFlash, whose anchor predicts nothing), exp(-(i-first)/gamma) for slot i >= first."""
    i = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(i >= first, torch.exp(-(i - first) / gamma), torch.zeros_like(i))


PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the loss decay the DFlash paper trains its block sizes with


def default_gamma(num_drafts):
    """The loss decay of a block draft that drafts `num_drafts` tokens, whichever slots draft them:
    the paper's for its DFlash blocks (num_drafts + 1 slots, the anchor drafting nothing), about
    half such a block otherwise. A DSpark block drafting as many tokens decays alike."""
    block = num_drafts + 1
    return PAPER_GAMMA.get(block, max(1.0, block / 2))


def block_logits(draft, aux_hidden, tokens, anchors, keep, embed_weight, head_weight):
    """Logits [B, N*S, V] of N packed blocks per row (anchor n's block at slots n*S..n*S+S-1),
    every block seeing the context before its anchor: one forward, as inference computes each block.
    aux_hidden [B, T, n_layers * H] and tokens [B, T] of whole sequences (the target's, detached)."""
    states, positions = block_states(draft, aux_hidden, tokens, anchors, keep, embed_weight)
    return draft.logits(states, head_weight), positions


def block_states(draft, aux_hidden, tokens, anchors, keep, embed_weight):
    """(final-normed states [B, N*S, H], positions [B, N*S]) of the packed blocks of `block_logits`."""
    s = draft.cfg.block_size
    b, t = tokens.shape
    offsets = torch.arange(s, device=tokens.device)
    positions = (anchors[:, :, None] + offsets).flatten(1)  # [B, N*S]
    block_tokens = torch.full_like(positions, draft.cfg.mask_token_id)
    block_tokens[:, ::s] = tokens.gather(1, anchors)
    context = draft.context(aux_hidden)
    kv = draft.context_kv(context, torch.arange(t, device=tokens.device).expand(b, t))
    mask = block_visibility(anchors, keep, t, s)
    return draft(F.embedding(block_tokens, embed_weight), positions, kv, mask), positions


def block_loss(draft, aux_hidden, tokens, loss_mask, embed_weight, head_weight, num_anchors, gamma=None,
               generator=None, loss_type="ce", policy_logits=None, temperature=1.0, topk=0):
    """DFlash's training objective on whole sequences: (weighted mean loss, per-slot mean loss [S-1]).

    Blocks anchored at random positions of the responses (`sample_anchors`), each slot i >= 1
    predicting token anchor+i where loss_mask marks it, weighted by exp(-(i-1)/gamma).
    `loss_type` names a per-position loss of mtp/loss.py's `MTP_LOSSES`: `ce` against the true
    token, or a distillation loss (`soft_ce`, `tv`) against the target's own distribution of that
    token: `policy_logits` [B, T, V] at position anchor+i-1 (its next-token logits), detached."""
    s = draft.cfg.block_size
    gamma = default_gamma(draft.cfg.num_drafts) if gamma is None else gamma
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator)
    logits, positions = block_logits(draft, aux_hidden, tokens, anchors, keep, embed_weight, head_weight)
    t = tokens.shape[1]
    inside = positions < t
    at = positions.clamp(max=t - 1)
    targets = tokens.gather(1, at)
    learn = loss_mask.gather(1, at).float() * inside * keep.repeat_interleave(s, 1)
    policy = None
    if policy_logits is not None:  # row r of the policy's logits is its distribution of token r + 1
        policy = policy_logits[torch.arange(tokens.shape[0], device=tokens.device)[:, None], (at - 1).clamp(min=0)]
    per_position = MTP_LOSSES[loss_type](logits.float(), targets, policy, temperature, topk)
    weights = position_weights(s, gamma, tokens.device).repeat(anchors.shape[1])[None] * learn
    loss = (per_position * weights).sum() / weights.sum().clamp(min=1e-9)
    b, n = anchors.shape
    slot_learn = learn.view(b, n, s)[..., 1:]
    per_slot = (per_position.view(b, n, s)[..., 1:] * slot_learn).sum((0, 1)) / slot_learn.sum((0, 1)).clamp(min=1)
    return loss, per_slot
