"""EAGLE-3 fixtures: the shipped tiny Qwen2 target and its draft, a draft cut down to a reduced vocabulary,
and a cache-free reference of greedy acceptance per draft position (random drafts of any kind:
draft_kind_fixtures.py)."""
import dataclasses
import os

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "checkpoints", "tiny-qwen2")
DRAFT = os.path.join(REPO, "checkpoints", "tiny-qwen2-eagle3")


# the tokens of the tiny Qwen2 target a reduced-vocabulary draft of the shipped one keeps, 16 of its 32: the
# special tokens, digits 0-5, the operators and separators, three ids no text uses. Its answers also hold
# digits 6-9: those the draft never drafts, and verification still emits them.
REDUCED_IDS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 16, 20, 21, 22)


def reduced_draft(draft, target_ids):
    """`draft` (a full-vocabulary Eagle3Draft) cut down to the target tokens `target_ids`: the same weights,
    its head only the rows of those tokens, and the format's tables written out by hand (target id = draft
    id + d2t[draft id]; t2d marks the target ids kept)."""
    from mtp.eagle3 import Eagle3Draft

    ids = torch.tensor(target_ids)
    state = {n: t.clone() for n, t in draft.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"][ids]
    state["d2t"] = ids - torch.arange(len(ids))
    state["t2d"] = torch.zeros(draft.cfg.vocab_size, dtype=torch.bool)
    state["t2d"][ids] = True
    reduced = Eagle3Draft(dataclasses.replace(draft.cfg, draft_vocab_size=len(ids)))
    reduced.load_state_dict(state, strict=True)
    return reduced.eval().requires_grad_(False)


def save_reduced_shipped_draft(path, target_ids=REDUCED_IDS):
    """The shipped draft cut down to `target_ids` (reduced_draft), saved in the EAGLE-3 format at `path`."""
    from vime.models.eagle3 import EAGLE3

    cfg, state = EAGLE3.load(DRAFT)
    full = EAGLE3.format.model(cfg)
    full.load_state_dict(state)
    draft = reduced_draft(full, target_ids)
    EAGLE3.save(str(path), draft.cfg, draft.state_dict())
    return str(path)


def reference_eagle3_drafts(target, draft, ids, k):
    """Greedy EAGLE-3 drafts for `ids` recomputed from scratch without any cache (the naive path
    the cached proposer is tested against): the draft over every position of `ids` reading the
    target's aux states, then k-1 steps each re-run over the whole extended sequence."""
    n = len(ids)
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        aux = target.aux_hidden_states(tokens, torch.arange(n)[None], draft.cfg.aux_layer_ids)
        hidden = draft.combine(aux[:, :n - 1])  # positions 0..n-2, tokens 1..n-1
        ext = list(ids)
        drafts = []
        for i in range(k):
            width = n - 1 + i
            embeds = F.embedding(torch.tensor([ext[1:1 + width]]), target.model.embed_tokens.weight)
            out = draft(embeds, hidden, torch.arange(width)[None])
            drafts.append(int(draft.logits(out[0, -1]).argmax()))
            ext.append(drafts[-1])
            hidden = torch.cat([hidden, out[:, -1:]], 1)
    return drafts


def greedy_continuation(target, ids, extra):
    """`ids` followed by `extra` greedy tokens of the target (full forwards, no stop)."""
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(extra):
            hidden = target(torch.tensor([ids]), torch.arange(len(ids))[None])
            ids.append(int(target.logits(hidden)[0, -1].argmax()))
    return ids


def reference_acceptance(target, draft, prompt, response, k, max_new_tokens, past_end=False):
    """(drafted, accepted) per draft position of greedy speculative decoding of `response`,
    with drafts recomputed without any cache at every verify step. Both backends count a draft the
    verify accepted even where a stop token ends the response before it (vLLM's definition).
    `past_end`: also draft k past the length budget (vLLM drafts k and counts them; the embedded
    engine never drafts what it may not emit)."""
    ids = greedy_continuation(target, list(prompt) + list(response), k + 1)
    drafted, accepted = [0] * k, [0] * k
    p, end = len(prompt) + 1, len(prompt) + len(response)  # the prefill emitted the first token
    while p < end:
        # the embedded engine never drafts past the length budget; vLLM drafts k and counts them
        budget = k if past_end else min(k, max_new_tokens - (p - len(prompt)) - 1)
        drafts = reference_eagle3_drafts(target, draft, ids[:p], budget)
        a = 0
        while a < budget and p + a < len(ids) and ids[p + a] == drafts[a]:
            a += 1
        for i in range(budget):
            drafted[i] += 1
        for i in range(a):
            accepted[i] += 1
        p += a + 1
    return drafted, accepted


def reference_ttt_losses(target, draft, tokens, loss_mask, steps):
    """EAGLE-3's training-time-test cross-entropy per drafting step, recomputed as the drafter runs,
    one prefix at a time and without any cache: for the prefix ending at token t+1 the draft runs over
    positions 0..t from the target's aux states, then each further step re-runs it over the whole
    extended sequence, its last entry reading the true next token and the draft's own previous output.
    Step m predicts token t+m+2; the loss is the mean over the batch's positions `loss_mask` marks."""
    sums, counts = [0.0] * steps, [0] * steps
    with torch.inference_mode():
        for b in range(tokens.shape[0]):
            row, n = tokens[b:b + 1], tokens.shape[1]
            aux = target.aux_hidden_states(row, torch.arange(n)[None], draft.cfg.aux_layer_ids)
            embeds = F.embedding(row, target.model.embed_tokens.weight)
            for t in range(n - 2):
                hidden = draft.combine(aux[:, :t + 1])
                for m in range(min(steps, n - t - 2)):
                    width = t + 1 + m  # positions 0..t+m, reading tokens 1..t+m+1
                    out = draft(embeds[:, 1:1 + width], hidden, torch.arange(width)[None])
                    if loss_mask[b, t + m + 2]:
                        sums[m] += float(F.cross_entropy(draft.logits(out[0, -1]).float(), tokens[b, t + m + 2]))
                        counts[m] += 1
                    hidden = torch.cat([hidden, out[:, -1:]], 1)
    return [s / c for s, c in zip(sums, counts)]
