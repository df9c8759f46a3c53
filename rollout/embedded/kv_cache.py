"""Preallocated per-slot KV cache and the per-step view that attention writes and reads.

Layout [layers, slots, positions, kv_heads, head_dim]. A slot's valid length lives with its
request; rolling back rejected speculative entries is just setting that length back, the
stale entries are overwritten by the next write. One `StepView` per forward hands every layer a
`LayerView` that writes the new keys/values and attends over the cache.

A step has fixed shapes (rollout/embedded/steps.py): every row writes all its Q query tokens'
entries at start .. start + Q - 1 and reads the first `k_len` positions of its slot, masked per
query by position (key j is visible to the query at position p when j <= p). A row bringing fewer
than Q tokens writes stale entries past its own, which the row's next step overwrites before
anything reads them; writes past the cache's end land on its last position, the scratch position
no request ever reaches (a padding row starts there). Masked entries meet a zero probability, so
the cache is allocated zeroed (never `empty`: 0 x NaN would leak into the sum).

Multi-head latent attention caches one latent row per token instead (`LatentKVCache`, layout
[layers, slots, positions, kv_lora_rank + qk_rope_head_dim]); `make_kv_cache` picks the kind a
model config needs.
"""
import torch

from rollout.embedded.fast_model import gqa_attention
from rollout.embedded.primitives import sdpa_attention
from rollout.embedded.steps import StepShape


class KVCache:
    """Preallocated keys/values [layers, slots, positions, kv_heads, head_dim]; rollback is a length reset.

    max_len positions, the last of them the scratch position (no valid entry ever sits there);
    `scratch_room` more positions past it for kernels that write a whole query window unclamped
    (flash-attn's cache update)."""

    fields = ("k", "v")  # the attributes holding the per-slot tensors

    def __init__(self, num_layers, num_slots, max_len, num_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 scratch_room=0):
        shape = (num_layers, num_slots, max_len + scratch_room, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._set_extent(num_slots, max_len, scratch_room)

    def _set_extent(self, num_slots, max_len, scratch_room):
        self.num_slots, self.scratch_position = num_slots, max_len - 1
        self.max_len = max_len + scratch_room  # positions allocated
        self.released = None

    @property
    def tensors(self):
        """Every per-slot tensor of the cache (slot copies and moves apply to each)."""
        return tuple(getattr(self, f) for f in self.fields)

    def release(self):
        """Give the cache's memory back (while a trainer on the same device steps); `restore` before use."""
        if self.released is None:
            self.released = {f: (t.shape, t.dtype, t.device) for f, t in zip(self.fields, self.tensors)}
            for f, (_, dtype, device) in self.released.items():
                setattr(self, f, torch.empty(0, dtype=dtype, device=device))

    def restore(self):
        """Allocate the released cache again, zeroed as at start: no request survives a release, and a
        slot's entries past its length are never read, so what decodes next is what a fresh cache gives."""
        if self.released is not None:
            for f, (shape, dtype, device) in self.released.items():
                setattr(self, f, torch.zeros(shape, dtype=dtype, device=device))
            self.released = None

    def copy_slots(self, src, dst, length):
        """Copy the first `length` positions of slots `src` (a tensor) into slots `dst` (every layer)."""
        for t in self.tensors:
            t[:, dst, :length] = t[:, src, :length]

    def move_slots(self, src, dst, length):
        """Copy the first `length` positions of slots `src` into slots `dst` (every layer), e.g. to
        keep a batch in consecutive slots."""
        length = min(length, self.max_len)
        device = self.tensors[0].device
        self.copy_slots(torch.tensor(src, device=device), torch.tensor(dst, device=device), length)

    def static_step(self, slots, starts, shape, backend="sdpa"):
        """The view of one fixed-shape step (rollout/embedded/steps.py): row b writes its
        shape.q_len tokens at starts[b].. and reads shape.k_len positions of slot slots[b]."""
        return StepView(self, slots, starts, shape, backend)

    def step(self, slots, starts, n_new, backend="sdpa"):
        """A view for one ragged forward outside the engine's steps (references, tests): row b
        writes n_new[b] tokens at starts[b].. (its shape read back from the tensors)."""
        slot_list, start_list, counts = slots.tolist(), starts.tolist(), n_new.tolist()
        first = slot_list[0]
        consecutive = slot_list == list(range(first, first + len(slot_list)))
        shape = StepShape(len(slot_list), max(1, max(counts)), max(s + c for s, c in zip(start_list, counts)),
                          first if consecutive else None)
        return self.static_step(slots, starts, shape, backend)


class LatentKVCache(KVCache):
    """Multi-head latent attention's cache: one [kv latent ; rope key] row per token and layer
    [layers, slots, positions, width], read by every head (rollout/embedded/mla.py)."""

    fields = ("latent",)

    def __init__(self, num_layers, num_slots, max_len, width, dtype=torch.float32, device="cpu"):
        self.latent = torch.zeros((num_layers, num_slots, max_len, width), dtype=dtype, device=device)
        self._set_extent(num_slots, max_len, 0)


def make_kv_cache(cfg, num_layers, num_slots, max_len, dtype=torch.float32, device="cpu", scratch_room=0):
    """The cache `cfg`'s attention needs: latent rows for MLA, per-head K/V otherwise."""
    if cfg.mla is not None:
        return LatentKVCache(num_layers, num_slots, max_len, cfg.mla.latent_width, dtype, device)
    return KVCache(num_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype, device, scratch_room)


class StepView:
    """The cache as one fixed-shape step sees it: where the rows' tokens go, what they read, the mask."""

    def __init__(self, cache, slots, starts, shape, backend):
        self.cache, self.slots, self.starts, self.shape, self.backend = cache, slots, starts, shape, backend
        self.positions = shape.positions(starts)  # [B, Q]
        self.rows = slots[:, None].expand(-1, shape.q_len)
        self.cols = self.positions.clamp(max=cache.max_len - 1)
        self._mask = None

    def mask(self, q_len=None):
        """[B, Q, L] key j visible to the query at position p: j <= p (built once per step)."""
        if self._mask is None:
            keys = torch.arange(self.shape.k_len, device=self.starts.device)
            self._mask = keys[None, None, :] <= self.positions[:, :, None]
        return self._mask

    def write(self, layer_cache, new):
        """Every row's Q new entries new [B, Q, ...] into this layer's cache."""
        layer_cache[self.rows, self.cols] = new

    def read(self, layer_cache):
        """[B, L, ...] the first k_len positions of every row's slot (a view for consecutive slots)."""
        first, shape = self.shape.first_slot, self.shape
        if first is not None:
            return layer_cache[first:first + shape.rows, :shape.k_len]
        return layer_cache[self.slots, :shape.k_len]

    def layers(self, n):
        return [LayerView(self, i) for i in range(n)]


class LayerView:
    """One layer's slice of a `StepView`: writes the new keys/values and attends over the cache."""

    def __init__(self, step, layer):
        self.step, self.layer = step, layer

    def attend(self, q, k, v, positions=None):
        """The module path's layout: q [B,H,Q,D], k/v [B,KV,Q,D] for the new tokens -> [B,H,Q,D]
        (masked by the step's own positions)."""
        return ATTENTION_BACKENDS[self.step.backend](self, q, k, v)

    def exchange_latent(self, entries):
        """Latent cache: write the new tokens' rows entries [B, Q, W]; return (every cached row of
        these slots [B, L, W], key positions [L])."""
        s = self.step
        layer = s.cache.latent[self.layer]
        s.write(layer, entries)
        return s.read(layer), torch.arange(s.shape.k_len, device=entries.device)

    def attend_bqhd(self, q, k, v):
        """The fast path's layout: q [B,Q,H,D], k/v [B,Q,KV,D] -> [B,Q,H,D]."""
        s, cache = self.step, self.step.cache
        if s.backend == "flash":
            return _flash_cached(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        k_layer, v_layer = cache.k[self.layer], cache.v[self.layer]
        s.write(k_layer, k)
        s.write(v_layer, v)
        return gqa_attention(q, s.read(k_layer), s.read(v_layer), s.mask())


def _sdpa_cached(view, q, k, v):
    s, cache = view.step, view.step.cache
    k_layer, v_layer = cache.k[view.layer], cache.v[view.layer]
    s.write(k_layer, k.transpose(1, 2))
    s.write(v_layer, v.transpose(1, 2))
    keys, values = s.read(k_layer).transpose(1, 2), s.read(v_layer).transpose(1, 2)
    return sdpa_attention(q, keys, values, s.positions, torch.arange(s.shape.k_len, device=q.device))


def _flash_cached(view, q, k, v):
    """flash-attn path (CUDA only): writes the new K/V into the cache at each row's start and
    attends causally (the cache needs `FLASH_QUERY_ROOM` positions past its scratch position)."""
    from flash_attn import flash_attn_with_kvcache

    s, cache = view.step, view.step.cache
    out = flash_attn_with_kvcache(
        q.transpose(1, 2), cache.k[view.layer], cache.v[view.layer],
        k=k.transpose(1, 2), v=v.transpose(1, 2), cache_seqlens=s.starts.int(),
        cache_batch_idx=s.slots.int(), causal=True)
    return out.transpose(1, 2)


ATTENTION_BACKENDS = {"sdpa": _sdpa_cached, "flash": _flash_cached}


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn kernels refuse fp32
# flash-attn writes a row's whole query window from its start, unclamped: the target cache keeps
# this many positions past its scratch position, and a verify brings at most FLASH_QUERY_ROOM tokens
FLASH_QUERY_ROOM = 32


def pick_attention_backend(device, requested="auto", dtype=torch.float32):
    """'flash' when CUDA, a half dtype and flash_attn are present (or asked for), else 'sdpa'."""
    if requested != "auto":
        from vime.errors import require

        require(requested != "flash" or dtype in FLASH_DTYPES,
                f"attention backend 'flash' needs fp16 or bf16 weights (got {dtype}); use 'sdpa' for fp32")
        return requested
    if torch.device(device).type != "cuda" or dtype not in FLASH_DTYPES:
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash"
