"""The DSpark draft (pure torch), written as vLLM's `Qwen3DSparkForCausalLM` (qwen3_dspark.py) computes it.

DSpark is a DFlash block draft (mtp/dflash.py: context from the target's layer states, one
forward over a block with attention not causal inside it) plus two small heads:

- the Markov head, a low-rank transition bias: `markov_w1` [V, r] embeds the token before a
  slot, `markov_w2` [V, r] maps that to a bias over the vocabulary added to the slot's logits.
  The block forward gives every slot's base logits at once; the drafts are then drawn left to
  right, slot i's logits being base_i + bias(draft i-1) (the anchor before slot 0). So the drafts
  of a block depend on each other again, which a purely parallel block loses;
- the confidence head, a linear map (with bias) of a slot's final-normed state, concatenated
  with its Markov embedding when `confidence_head_with_markov`, whose sigmoid predicts that the
  slot's draft is accepted. Verification can be sized by it (rollout/embedded/proposers/dspark.py).

Block layout (vLLM's `sample_from_anchor`): with n tokens known, the block is the newest token
x_{n-1} (the anchor) followed by block_size - 1 noise tokens (`dspark_noise_token_id`) at
positions n-1 .. n-2+block_size, and slot i's logits are the NEXT token's, x_{n+i}: a block of
block_size slots drafts block_size tokens (DFlash's block of the same size drafts one fewer).

Training (`dspark_loss`), the public recipes' three terms on packed blocks anchored at random
response positions, the Markov head teacher-forced with the true tokens:
  ce_weight * CE(draft, true token) + l1_weight * ||softmax(draft) - policy||_1
  + confidence_weight * BCE(confidence, 1 - TV),
the L1 distance and the acceptance label 1 - TV = 1 - L1/2 read at the rollout temperature against
the detached policy's distribution, every term weighted by exp(-i/gamma) at slot i, gamma by default
that of a DFlash block drafting as many tokens (mtp/dflash.py `default_gamma`). The defaults
(`RECIPE_WEIGHTS`) are the recipes' (docs/drafts.md cites them).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtp.dflash import DFlashConfig, DFlashDraft, block_states, default_gamma, position_weights, sample_anchors
from mtp.loss import MTP_LOSSES

# ce on the true token, l1 on the policy's distribution, bce of the confidence head: NeMo AutoModel's
# DSparkTrainerModule (ce_loss_alpha, l1_loss_alpha, confidence_head_alpha), speculators' DSpark
RECIPE_WEIGHTS = {"ce": 0.1, "l1": 0.9, "confidence": 1.0}


@dataclass(frozen=True, kw_only=True)
class DSparkConfig(DFlashConfig):
    """A DFlash backbone's config plus the heads'. `mask_token_id` is the noise token
    (`dspark_noise_token_id`); `block_size` is the number of block slots, each drafting a token."""

    markov_rank: int = 32
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = False

    @property
    def num_drafts(self):
        return self.block_size  # every slot, the anchor's included, drafts the token after it

    @property
    def confidence_input_size(self):
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)


class MarkovHead(nn.Module):
    """The low-rank transition bias (vLLM's DSparkMarkovHead): token -> r-dim embedding -> [V] bias."""

    def __init__(self, vocab_size, rank):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def corrector(self):
        """(logits [..., V], the tokens before those slots [...]) -> (logits + the tokens' transition bias, their
        embeddings [..., r]), on the weights read here once. Why: slot-by-slot drafting runs it once per slot, and at
        one row reading the weights through the modules at every slot was half of the Markov stage's time."""
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight

        def correct(logits, tokens):
            embeds = F.embedding(tokens, w1)
            return logits + F.linear(embeds, w2).to(logits.dtype), embeds
        return correct


class ConfidenceHead(nn.Module):
    """Per-slot acceptance logit (vLLM's DSparkConfidenceHead), computed in fp32 as vLLM does."""

    def __init__(self, input_size, with_markov):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_size, 1, bias=True)

    def forward(self, states, markov_embeds):
        x = torch.cat([states, markov_embeds], -1) if self.with_markov else states
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """The DFlash draft with a Markov head and, if configured, a confidence head (see module doc)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = (ConfidenceHead(cfg.confidence_input_size, cfg.confidence_head_with_markov)
                                if cfg.enable_confidence_head else None)

    def markov_logits(self, base_logits, previous_tokens):
        """(base logits + the transition bias of the tokens before each slot, their Markov embeddings)."""
        return self.markov_head.corrector()(base_logits, previous_tokens)

    def confidence_logits(self, states, markov_embeds):
        """[...] acceptance logits of slots with final-normed states [..., H]; None without the head."""
        if self.confidence_head is None:
            return None
        return self.confidence_head(states, markov_embeds)


def draft_left_to_right(draft, base_logits, anchor_tokens, pick):
    """The sequential stage: base_logits [B, k, V] of the block's first k slots, anchors [B];
    pick(i, logits [B, V]) -> (tokens [B], q [B, V] or None) draws slot i from its Markov-corrected
    logits. Returns (drafts [B, k], q [B, k, V] or None, Markov embeddings [B, k, r])."""
    previous, tokens, probs, embeds = anchor_tokens, [], [], []
    correct = draft.markov_head.corrector()
    for i, base in enumerate(base_logits.unbind(1)):
        logits, embed = correct(base, previous)
        previous, q = pick(i, logits)
        tokens.append(previous)
        probs.append(q)
        embeds.append(embed)
    q = torch.stack(probs, 1) if probs and probs[0] is not None else None
    return torch.stack(tokens, 1), q, torch.stack(embeds, 1)


def acceptance_confidence(draft, states, markov_embeds):
    """[B, k] predicted acceptance of each drafted slot (sigmoid of the head), None without the head."""
    logits = draft.confidence_logits(states, markov_embeds)
    return None if logits is None else torch.sigmoid(logits)


# ---------------------------------------------------------------- training: the recipes' three terms
def _l1(draft_logits, targets, policy_logits, temperature, topk):
    return 2 * MTP_LOSSES["tv"](draft_logits, targets, policy_logits, temperature, topk)


def dspark_loss(draft, aux_hidden, tokens, loss_mask, embed_weight, head_weight, num_anchors, policy_logits,
                weights=None, gamma=None, generator=None, temperature=1.0, topk=0):
    """DSpark's objective on whole sequences: (weighted mean loss, per-slot mean loss [S], per-term
    weighted means {ce, l1, confidence}).

    Blocks anchored at random response positions (mtp/dflash.py `sample_anchors`), packed into one
    forward; slot i of anchor a predicts token a+i+1 where loss_mask marks it, its Markov bias
    read from the true token a+i. policy_logits [B, T, V]: the detached policy's logits (row r is
    its distribution of token r + 1), for the L1 term and the confidence head's label."""
    w = dict(RECIPE_WEIGHTS, **(weights or {}))
    s = draft.cfg.block_size
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator)
    states, positions = block_states(draft, aux_hidden, tokens, anchors, keep, embed_weight)
    t = tokens.shape[1]
    inside = positions + 1 < t
    here, nxt = positions.clamp(max=t - 1), (positions + 1).clamp(max=t - 1)
    logits, embeds = draft.markov_logits(draft.logits(states, head_weight), tokens.gather(1, here))
    logits = logits.float()
    targets = tokens.gather(1, nxt)
    learn = loss_mask.gather(1, nxt).float() * inside * keep.repeat_interleave(s, 1)
    policy = policy_logits[torch.arange(tokens.shape[0], device=tokens.device)[:, None], here]
    l1 = _l1(logits, targets, policy, temperature, topk)
    terms = {"ce": MTP_LOSSES["ce"](logits, targets, None, temperature, topk), "l1": l1}
    conf = draft.confidence_logits(states, embeds)
    if conf is not None:
        label = (1 - l1.detach() / 2).clamp(0, 1)
        terms["confidence"] = F.binary_cross_entropy_with_logits(conf, label, reduction="none")
    gamma = default_gamma(draft.cfg.num_drafts) if gamma is None else gamma
    weight = position_weights(s, gamma, tokens.device, first=0).repeat(anchors.shape[1])[None] * learn
    per_position = sum(w[name] * term for name, term in terms.items())
    norm = weight.sum().clamp(min=1e-9)
    loss = (per_position * weight).sum() / norm
    b, n = anchors.shape
    slot_learn = learn.view(b, n, s)
    per_slot = (per_position.view(b, n, s) * slot_learn).sum((0, 1)) / slot_learn.sum((0, 1)).clamp(min=1)
    parts = {name: float((term.detach() * weight).sum() / norm) for name, term in terms.items()}
    return loss, per_slot, parts
