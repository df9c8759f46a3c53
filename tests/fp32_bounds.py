"""Tolerances for comparing two fp32 computations that differ only in reduction order.

Two CPUs (AVX2 vs AVX-512), two TP shards or two DP ranks sum the same terms in a
different order. Higham's bound for a length-n sum is |error| <= n * u * sum|terms|
(u = 2**-24, the fp32 unit roundoff); a chain of `depth` such reductions compounds to
about depth * n * u relative. Tolerances are that worst case, scaled by the quantity:
still orders of magnitude below what a real bug (a wrong shard, a missing all-reduce)
changes, and independent of the machine that runs the test.
"""
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def reduction_rtol(longest_reduction, depth):
    """Worst-case relative error of `depth` chained fp32 reductions of length <= `longest_reduction`."""
    return depth * longest_reduction * FP32_UNIT_ROUNDOFF


def close(a, b, rtol, scale=None):
    """|a - b| <= rtol * scale, scale defaulting to max(|a|, |b|, 1): losses are means of O(1)
    terms, so when they cancel to near zero the terms' size, not the result's, sets the error."""
    scale = max(abs(a), abs(b), 1.0) if scale is None else scale
    return abs(a - b) <= rtol * scale
