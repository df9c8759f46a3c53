"""Offline warm-up of a draft on its target's own sequences (pure torch).

Every draft kind starts from a short offline fit before RL: batches of the target's samples, the frozen
target's hidden states, the kind's own loss. The target does not train, so its states are computed once per
sequence and every step reads them back (causal attention: a sequence's states do not depend on the batch
or the padding after it). The loop is the same for every external kind (EAGLE-3, DFlash, DSpark); the kind
brings only its loss. Fresh MTP layers (mtp/fresh_layers.py) share the batching and the states.
"""
import random
import time

import torch


def padded_tokens(sequences, rows):
    """The chosen rows' tokens [B, T], zero-padded at the end."""
    tokens = torch.zeros(len(rows), max(len(sequences[i]) for i in rows), dtype=torch.long)
    for r, i in enumerate(rows):
        tokens[r, :len(sequences[i])] = torch.tensor(sequences[i])
    return tokens


def states_per_sequence(sequences, batch_size, states_of):
    """[states_of(tokens [b, T], positions [b, T])[r, :len_i] for sequence i], computed without gradients in
    batches of `batch_size` sequences (states_of: the frozen target's states of a batch, [b, T, ...])."""
    states = []
    for first in range(0, len(sequences), batch_size):
        rows = list(range(first, min(first + batch_size, len(sequences))))
        tokens = padded_tokens(sequences, rows)
        with torch.no_grad():
            batch = states_of(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
        states += [batch[r, :len(sequences[i])] for r, i in enumerate(rows)]
    return states


def padded_states(states, rows, width):
    """The chosen rows' states (of `states_per_sequence`) zero-padded to [B, width, ...]."""
    out = torch.zeros(len(rows), width, *states[0].shape[1:], dtype=states[0].dtype)
    for r, i in enumerate(rows):
        out[r, :len(states[i])] = states[i]
    return out


def warm_up_draft(draft, target, sequences, steps, batch_size, lr, seed, loss_of, per_what, log=print):
    """`steps` AdamW steps of `draft` on random batches of `sequences`.

    loss_of(tokens, mask, aux): (loss, per-position losses) of the kind, where aux are the target's
    detached hidden states at the draft's aux layers; `per_what` names those positions in the log."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    start = time.time()
    aux_states = states_per_sequence(
        sequences, batch_size, lambda tokens, positions: target.aux_hidden_states(tokens, positions,
                                                                                  draft.cfg.aux_layer_ids))
    for step in range(steps):
        rows = [rng.randrange(len(sequences)) for _ in range(batch_size)]
        tokens = padded_tokens(sequences, rows)
        mask = (torch.arange(tokens.shape[1]) < torch.tensor([len(sequences[i]) for i in rows])[:, None]).float()
        loss, per_position = loss_of(tokens, mask, padded_states(aux_states, rows, tokens.shape[1]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"warm-up step {step:4d}  loss by {per_what} " + " ".join(f"{x.item():.3f}" for x in per_position)
                + f"  {time.time() - start:.0f}s")
