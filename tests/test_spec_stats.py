"""Aggregated speculation statistics are token-weighted, not means of per-sample ratios."""
from rollout.spec_stats import aggregate_spec_stats
from vime.sample import Sample, SpecStats


def sample(n_tokens, steps, drafted, accepted, drafted_pos, accepted_pos):
    return Sample(prompt_ids=[1], response_ids=[5] * n_tokens,
                  spec=SpecStats(steps, drafted, accepted, accepted_pos, drafted_pos))


def test_aggregates_sum_counts_before_dividing():
    # sample a: prefill (1 token) + 3 verify steps of 2 drafts, 5 accepted -> 1 + 8 tokens
    a = sample(9, 4, 6, 5, [3, 3], [3, 2])
    # sample b: prefill + 1 verify step of 2 drafts, 0 accepted -> 1 + 1 tokens
    b = sample(2, 2, 2, 0, [1, 1], [0, 0])
    st = aggregate_spec_stats([a, b])
    assert st["spec_draft_tokens"] == 8 and st["spec_accepted_tokens"] == 5
    assert st["spec_accept_rate"] == 5 / 8  # a mean of ratios would give (5/6 + 0) / 2
    # vLLM's definition: 1 + accepted tokens per drafting step (4 steps drafted a position 0)
    assert st["spec_accept_length"] == 1 + 5 / 4
    assert st["spec_accept_rate_pos_0"] == 3 / 4 and st["spec_accept_rate_pos_1"] == 2 / 4


def test_plain_decoding_has_length_one_and_no_drafts():
    st = aggregate_spec_stats([sample(7, 7, 0, 0, [], [])])
    assert st["spec_accept_length"] == 1.0 and st["spec_accept_rate"] == 0.0
    assert not any(k.startswith("spec_accept_rate_pos_") for k in st)
