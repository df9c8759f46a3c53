"""Static steps: a ragged batch laid out as fixed-shape tensors, and a step function run on them —
eagerly, or on CUDA as one captured CUDA graph per shape, replayed (nano-vllm's way).

A step is one forward over the KV caches: the target's decode or verify (1 + k query tokens a
row), a draft layer's catch-up or drafting step, a DFlash context write or block. Its function
reads tensors only — its inputs, the weights, the caches — and everything data-dependent is
settled on the host before it runs, from what the engine knows there anyway (each row's slot,
length and how many tokens it brings): the `StepShape` (rows, query length, keys read, whether
the rows sit in consecutive slots), the padded inputs. Inside a step nothing waits for the device
(no `.item()`, `.tolist()`, boolean indexing or Python branch on a tensor's value), so on CUDA a
step can be captured once per shape and replayed; what needs the host (verification's result,
the next rows) happens between steps.

Graphs need fixed shapes, so where steps run as graphs rows are padded up to a batch bucket
(`row_bucket`) and the keys read up to a length bucket (`key_bucket`); elsewhere (the CPU
default) a step has exactly the batch's shape and does no extra work. A padding row brings
token 0, reads like any row and writes only at its slot's scratch position (past every valid
entry: kv_cache.py), so padding changes no real row's output.

`StepRunner.layout` decides whether a step runs as a graph (graphs on, a step function that allows
it, a decode / verify window) and `StepRunner.run` runs it so. A captured graph owns static
copies of its inputs; its outputs live in one buffer per step family shared by all of that
family's graphs (sized for the largest), so a replay overwrites the previous output of the same
family: callers use an output before the next step of that family, and copy what they keep.
All graphs share one memory pool (a graph's intermediates are free once it has run).
"""
from dataclasses import dataclass
from typing import Optional

import torch

SMALL_ROW_BUCKETS = (1, 2, 4, 8)  # then every multiple of ROW_BUCKET_STEP (vLLM and nano-vllm do the same)
ROW_BUCKET_STEP = 16
MIN_KEY_BUCKET = 64  # keys read by a graphed step: a power of two, at least this many


def device_tensor(values, device, dtype=torch.long):
    """A step input built on the host: on CUDA staged in pinned memory and copied without waiting
    for the device (a plain copy from pageable memory waits for every queued kernel)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def row_bucket(n, max_rows):
    """The padded row count of a graphed step of n rows: 1, 2, 4, 8, then multiples of 16,
    never past max_rows (itself a bucket)."""
    for b in SMALL_ROW_BUCKETS:
        if n <= b:
            return min(b, max_rows)
    return min(-(-n // ROW_BUCKET_STEP) * ROW_BUCKET_STEP, max_rows)


def key_bucket(n, cap):
    """Keys a graphed step reads when its rows need n: the next power of two (at least
    MIN_KEY_BUCKET), never past the cache's `cap` positions."""
    return min(max(MIN_KEY_BUCKET, 1 << max(0, n - 1).bit_length()), cap)


@dataclass(frozen=True)
class StepShape:
    """Everything about a step's tensors that a graph fixes: rows (padding included), query
    tokens per row, keys each row reads from the cache, and the first of the consecutive slots the
    rows sit in (None: they are scattered and their keys are gathered)."""

    rows: int
    q_len: int
    k_len: int
    first_slot: Optional[int] = None

    def positions(self, starts):
        """[B, Q] the positions of every row's query tokens (starts [B])."""
        return starts[:, None] + torch.arange(self.q_len, device=starts.device)[None, :]


@dataclass
class StepLayout:
    """A ragged batch of n rows laid out for one step: its shape, the padded slot and start of
    each row (device tensors), and the real rows' slots, starts and token counts (host)."""

    n: int
    shape: StepShape
    slots: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]
    slot_list: list
    start_list: list
    counts: list
    graphed: bool = False  # the step runs as a captured graph

    def tokens(self, rows):
        """[B, Q] long: each real row's tokens (host lists) right-padded with 0, then padding rows of 0."""
        q = self.shape.q_len
        padded = [list(r) + [0] * (q - len(r)) for r in rows] + [[0] * q] * (self.shape.rows - self.n)
        return device_tensor(padded, self.slots.device)

    def pad(self, x, width=None):
        """x [n, W, ...] -> [B, width or W, ...]: zero padding rows (and columns up to `width`)."""
        rows, cols = self.shape.rows - self.n, 0 if width is None else width - x.shape[1]
        if rows == 0 and cols == 0:
            return x
        out = x.new_zeros((self.shape.rows, x.shape[1] + cols, *x.shape[2:]))
        out[:self.n, :x.shape[1]] = x
        return out

    def pad_rows(self, x):
        """x [n, ...] -> [B, ...] with zero padding rows."""
        if self.shape.rows == self.n:
            return x
        return torch.cat([x, x.new_zeros((self.shape.rows - self.n, *x.shape[1:]))])


class StepRunner:
    """Lays batches out and runs step functions: eagerly, or (CUDA, `graphs`) as captured graphs.

    pad: pad rows and keys up to buckets (default: exactly when steps run as graphs; forcing it
    on CPU shows padding changes no output). capture: the capture kind (CAPTURES), `cuda` for
    real graphs; `trace` stands in for it where there is no CUDA: each step is traced whole by
    torch.compile (fullgraph, so anything that would need the host inside a step fails) and
    replayed with a graph's buffer semantics."""

    def __init__(self, device, graphs=False, pad=None, max_rows=1, capture="cuda", compile_steps=False):
        self.device = torch.device(device)
        self.graphs = graphs and (capture != "cuda" or self.device.type == "cuda")
        self.pad = pad
        self.max_rows = max_rows
        # longer query windows (a prompt, a catch-up after many steps without drafts) run eagerly:
        # graphs are for the steps that repeat, decode and verify (the engine sets 1 + k)
        self.max_graph_q_len = 1
        self.capture_kind, self.compile_steps = capture, compile_steps
        self.captured = {}
        self.shared = {}  # (family, output index) -> flat buffer every graph of the family writes into
        self.pool = None

    def forget(self, prefix):
        """Drop the graphs (and output buffers) of the step families whose name starts with `prefix`."""
        self.captured = {k: g for k, g in self.captured.items() if not k[0].startswith(prefix)}
        self.shared = {k: b for k, b in self.shared.items() if not k[0].startswith(prefix)}

    def reset(self):
        """Drop every captured graph (the caches or fused weights they read were replaced)."""
        self.captured.clear()
        self.shared.clear()
        self.pool = None

    # ---------------------------------------------------------------- layout
    def layout(self, cache, slots, starts, counts, graphable=True):
        """The layout of rows in `slots` (host ints) writing counts[i] tokens from starts[i] into
        `cache`. It runs as a graph when graphs are on, the step function allows it (`graphable`)
        and its query window is a decode / verify one; padded to buckets then (or always, or
        never, when `pad` says so)."""
        n = len(slots)
        graphed = self.graphs and graphable and max(counts) <= self.max_graph_q_len
        padded = graphed if self.pad is None else self.pad
        need = max(s + c for s, c in zip(starts, counts))
        rows = row_bucket(n, max(self.max_rows, n)) if padded else n
        shape_k = key_bucket(need, cache.max_len) if padded else min(need, cache.max_len)
        first = slots[0]
        consecutive = slots == list(range(first, first + n)) and first + rows <= cache.num_slots
        pad_slots = list(range(first + n, first + rows)) if consecutive else [first] * (rows - n)
        shape = StepShape(rows, max(1, max(counts)), shape_k, first if consecutive else None)
        return StepLayout(n, shape, device_tensor(slots + pad_slots, self.device),
                          device_tensor(list(starts) + [cache.scratch_position] * (rows - n), self.device),
                          slots, list(starts), list(counts), graphed)

    # ---------------------------------------------------------------- running
    def run(self, key, fn, inputs, graphed):
        """fn(*inputs) -> tuple of tensors, as a graph when `graphed` (the layout's). key = (family,
        StepShape, anything else the function depends on): one graph per key; the outputs are
        shared by the family's graphs."""
        if not graphed:
            return fn(*inputs)
        graph = self.captured.get(key)
        if graph is None:
            graph = self.captured[key] = CAPTURES[self.capture_kind](self, key[0], self._compiled(fn), inputs)
        graph.replay(inputs)
        return graph.outputs

    def _compiled(self, fn):
        return compile_step(fn) if self.compile_steps else fn

    def shared_output(self, family, index, like):
        """A view shaped like `like` of the family's index-th output buffer (grown if too small)."""
        buf = self.shared.get((family, index))
        if buf is None or buf.numel() < like.numel() or buf.dtype != like.dtype:
            buf = self.shared[(family, index)] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buf[:like.numel()].view(like.shape)


def compile_step(fn, **options):
    """torch.compile of one step function, whole (fullgraph) at its static shapes. Every graph key
    compiles the same function at other shapes, so torch's per-function recompile limit is raised."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4096)
    return torch.compile(fn, fullgraph=True, dynamic=False, **options)


class CudaGraphStep:
    """One step captured as a CUDA graph: static inputs, outputs in the family's shared buffers."""

    def __init__(self, runner, family, fn, inputs):
        self.inputs = [x.clone() for x in inputs]
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces, compiled kernels) before capture
            warm = fn(*self.inputs)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        self.outputs = [runner.shared_output(family, i, o) for i, o in enumerate(warm)]
        del warm
        if runner.pool is None:
            runner.pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=runner.pool):
            for out, value in zip(self.outputs, fn(*self.inputs)):
                out.copy_(value)

    def replay(self, inputs):
        for static, x in zip(self.inputs, inputs):
            static.copy_(x, non_blocking=True)
        self.graph.replay()


class TracedStep:
    """A stand-in for a CUDA graph on any device: the step traced whole (torch.compile,
    fullgraph, eager backend: a step that would need the host fails here), run on static copies
    of its inputs, its outputs written into the family's shared buffers."""

    def __init__(self, runner, family, fn, inputs):
        self.inputs = [x.clone() for x in inputs]
        self.fn = compile_step(fn, backend="eager")
        self.outputs = [runner.shared_output(family, i, o) for i, o in enumerate(self.run())]

    def run(self):
        import torch._dynamo

        # a process may have switched dynamo off (trainer/cpu_patches.py does on CPU): the trace is the point here
        with torch._dynamo.config.patch(disable=False):
            return self.fn(*self.inputs)

    def replay(self, inputs):
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        for out, value in zip(self.outputs, self.run()):
            out.copy_(value)


CAPTURES = {"cuda": CudaGraphStep, "trace": TracedStep}
