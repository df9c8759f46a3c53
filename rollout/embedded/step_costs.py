"""The engine's step costs, profiled once at start-up: what the k policies price steps with.

`profile_steps` times the engine's own passes (a verify forward of 1 + k tokens, the proposer's drafting
of k) at a power-of-two grid of batch sizes, every point the best of PROFILE_REPEATS, the points taken in
rounds; `interpolate` reads a point between grid sizes, `monotone_envelope` drops the outliers.
"""
import math

PROFILE_REPEATS = 5  # best-of repeats per profiled point


def profile_steps(engine, k_max):
    """(batch grid, {k: verify seconds per grid size}, {k: draft seconds per grid size}) for k = 0..k_max.
    The points are interleaved (each once a round, after one untimed round), so a machine whose speed
    drifts while it profiles slows every point alike instead of the ks profiled last."""
    grid = batch_grid(engine.config.max_batch_size)
    ks = range(k_max + 1)
    verify = {k: [math.inf] * len(grid) for k in ks}
    draft = {k: [math.inf] * len(grid) for k in ks}
    for timed in [False] + [True] * PROFILE_REPEATS:
        for i, b in enumerate(grid):
            for k in ks:
                v = engine.profile_verify(b, 1 + k, repeats=1, warm_up=False)
                d = engine.profile_draft(b, k, repeats=1, warm_up=False)
                if timed:
                    verify[k][i], draft[k][i] = min(verify[k][i], v), min(draft[k][i], d)
    return grid, monotone_envelope(verify), monotone_envelope(draft)


def interpolate(grid, ys, b):
    """ys (one per grid batch size) at b, linear between grid points."""
    if b <= grid[0]:
        return ys[0] * b / grid[0]
    for x0, x1, y0, y1 in zip(grid, grid[1:], ys, ys[1:]):
        if b <= x1:
            return y0 + (y1 - y0) * (b - x0) / (x1 - x0)
    return ys[-1]


def monotone_envelope(profiled):
    """{k: [seconds per grid batch size]} lowered so cost never falls with more rows or more tokens:
    interference from other work only adds time to a measurement, so a point costing more than one doing
    strictly more work (more tokens at the same batch size, more rows at the same k) is the outlier, and
    is capped by every point above it."""
    ks = sorted(profiled)
    out = {k: list(profiled[k]) for k in ks}
    for i in reversed(range(len(ks) - 1)):  # suffix-min over k
        out[ks[i]] = [min(a, b) for a, b in zip(out[ks[i]], out[ks[i + 1]])]
    for k in ks:  # suffix-min over the batch grid
        ys = out[k]
        for j in reversed(range(len(ys) - 1)):
            ys[j] = min(ys[j], ys[j + 1])
    return out


def batch_grid(max_batch_size):
    """1, 2, 4, ... up to and including max_batch_size."""
    grid = [2 ** i for i in range(int(math.log2(max_batch_size)) + 1)]
    return grid if grid[-1] == max_batch_size else grid + [max_batch_size]
