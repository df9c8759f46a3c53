"""Training a reused MTP layer on exactly the inputs the drafter gives it (EAGLE-3's training-time test).

Past its last MTP layer the drafter reuses that layer one position further: drafting after
position t, reuse step m (m = 1, 2, ...) sits at position t+m, reads the layer's previous
output at t+m-1 and the previous draft, and attends over the layer's cache: its true
entries at positions <= t plus the entries that reuse steps 1..m-1 wrote at t+1..t+m-1.

Every t is a drafting point in training, so the sequence is laid out in blocks of S entries:
block 0 is the layer's own run (entry t at position t), block m its m-th reuse step for every
t at once (entry t at position t+m). Entry t of block m >= 1 may attend to block 0 at
positions <= t and to entry t of blocks 1..m; block 0 stays causal. Block 0's outputs are
unchanged by the later blocks, so one forward over blocks 0..m gives reuse step m.
"""
import torch

# --mtp-reuse-attention: how trained depths past the last MTP layer attend (trainer/model.py):
# exactly as the drafter runs them, or chained as megatron chains layers (Megatron-LM's
# repeated-layer MTP, attention over its own depth's entries at every position)
REUSE_ATTENTION = ("drafter", "megatron")


def reuse_positions(seq_len, blocks, device=None):
    """[blocks * seq_len] rotary position of each entry: t + m for entry t of block m."""
    t = torch.arange(seq_len, device=device)
    return torch.cat([t + m for m in range(blocks)])


def reuse_attention_mask(seq_len, blocks, device=None):
    """[N, N] bool, N = blocks * seq_len, True where a query may NOT attend (megatron's convention)."""
    n = blocks * seq_len
    idx = torch.arange(n, device=device)
    block, t = idx // seq_len, idx % seq_len
    q_block, q_t, k_block, k_t = block[:, None], t[:, None], block[None, :], t[None, :]
    causal_base = (k_block == 0) & (k_t <= q_t)
    own_chain = (k_block >= 1) & (k_block <= q_block) & (k_t == q_t)
    return ~(causal_base | own_chain)
