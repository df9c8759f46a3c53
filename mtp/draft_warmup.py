"""Offline warm-up of an external draft on its target's own sequences (pure torch).

Every external draft kind (EAGLE-3, DFlash, DSpark) starts from a short offline fit before RL: batches of
the target's samples, the target's hidden states recomputed without gradients, the kind's own loss.
The loop is the same for every kind; the kind brings only its loss.
"""
import random
import time

import torch


def padded_batch(sequences, rng, batch_size):
    """(tokens [B, T] zero-padded, mask [B, T] of real positions) of batch_size sequences drawn at random."""
    batch = [rng.choice(sequences) for _ in range(batch_size)]
    width = max(len(x) for x in batch)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width)
    for i, x in enumerate(batch):
        tokens[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return tokens, mask


def warm_up_draft(draft, target, sequences, steps, batch_size, lr, seed, loss_of, per_what, log=print):
    """`steps` AdamW steps of `draft` on random batches of `sequences`.

    loss_of(tokens, mask, aux): (loss, per-position losses) of the kind, where aux are the target's
    detached hidden states at the draft's aux layers; `per_what` names those positions in the log."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    start = time.time()
    for step in range(steps):
        tokens, mask = padded_batch(sequences, rng, batch_size)
        with torch.no_grad():
            aux = target.aux_hidden_states(tokens, torch.arange(tokens.shape[1]).expand_as(tokens),
                                           draft.cfg.aux_layer_ids)
        loss, per_position = loss_of(tokens, mask, aux)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"warm-up step {step:4d}  loss by {per_what} " + " ".join(f"{x.item():.3f}" for x in per_position)
                + f"  {time.time() - start:.0f}s")
