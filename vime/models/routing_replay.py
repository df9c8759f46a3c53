"""Routes of a rollout, as the trainer replays them (rollout routing replay; pure torch).

A route is the set of k experts one MoE decoder layer chose for one token position. A rollout
records them for every position of a sample but the last (the last token is emitted, never fed
back, and no trained log-prob reads its hidden state): `Sample.routed_experts` is
[len(tokens) - 1, MoE decoder layers, k] of small integers (`route_dtype`), never floats.

`RouteTable` is the recorder both rollout backends share: rows (engine slots, or vLLM requests)
x positions, written by every forward with "last write wins". A verify forward writes routes for
positions p..p+k, rejected drafts included; the next forward feeds the token that was kept at
the first rejected position and rewrites it, so once a sample is done every position before its
last token holds the routes of the token it finally has there.
"""
import torch

NO_ROUTE = -1  # a position without a rollout route in a training batch (its last token, padding)


def route_dtype(num_experts):
    """The integer dtype a route is stored in: uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class RouteTable:
    """Last-write-wins routes [rows, positions, layers, k] of the requests an engine is running."""

    def __init__(self, rows, positions, num_layers, k, num_experts, device="cpu", track_writes=False):
        self.routes = torch.zeros(rows, positions, num_layers, k, dtype=route_dtype(num_experts), device=device)
        # [rows, positions, layers] bool, where a recorder must prove every position was routed
        self.written = (torch.zeros(rows, positions, num_layers, dtype=torch.bool, device=device)
                        if track_writes else None)

    @property
    def num_layers(self):
        return self.routes.shape[2]

    def write(self, layer, rows, positions, indices):
        """Routes `indices` [T, k] of MoE decoder layer `layer` for (rows[t], positions[t])."""
        self.routes[rows, positions, layer] = indices.to(self.routes.dtype)
        if self.written is not None:
            self.written[rows, positions, layer] = True

    def routed_prefix(self, row):
        """How many leading positions of row `row` every layer wrote (needs track_writes)."""
        unwritten = (~self.written[row].all(dim=1)).nonzero()
        return int(unwritten[0]) if len(unwritten) else self.written.shape[1]

    def read(self, row, length):
        """A copy of row `row`'s routes at positions 0..length-1: [length, layers, k]."""
        return self.routes[row, :length].clone()

    def copy_rows(self, src, dst, length):
        """Positions 0..length-1 of rows `src` into rows `dst` (a shared prompt, a moved slot)."""
        if len(src):
            self.routes[dst, :length] = self.routes[src, :length]


def batch_routes(samples, width):
    """[B, width, layers, k] int16 of the samples' routes, NO_ROUTE where a position has none;
    None when any sample carries none (a dense model, or a rollout that recorded no routes)."""
    routes = [s.routed_experts for s in samples]
    if not routes or any(r is None for r in routes):
        return None
    out = torch.full((len(routes), width, *routes[0].shape[1:]), NO_ROUTE, dtype=torch.int16)
    for i, r in enumerate(routes):
        out[i, :r.shape[0]] = torch.as_tensor(r).to(torch.int16)
    return out


def routes_differ(own, rollout):
    """[T] bool: where the expert *sets* of own [T, k] and rollout [T, k] differ (order is free)."""
    return (own.sort(dim=-1).values != rollout.sort(dim=-1).values).any(dim=-1)


def route_bytes(sample):
    """Bytes one sample's routes take (0 without routes)."""
    r = sample.routed_experts
    return 0 if r is None else r.numel() * r.element_size()
