"""Preallocated per-slot KV cache and the per-step view that attention writes and reads.

Layout [layers, slots, max_len, kv_heads, head_dim]. A slot's valid length lives with its
request; rolling back rejected speculative entries is just setting that length back, the
stale entries are overwritten by the next write. One `StepView` per forward precomputes the
ragged write indices once and hands every layer a `LayerView` with `attend`.

Multi-head latent attention caches one latent row per token instead (`LatentKVCache`, layout
[layers, slots, max_len, kv_lora_rank + qk_rope_head_dim]); `make_kv_cache` picks the kind a
model config needs.
"""
import torch

from rollout.embedded.fast_model import gqa_attention
from rollout.embedded.primitives import sdpa_attention


class KVCache:
    """Preallocated keys/values [layers, slots, max_len, kv_heads, head_dim]; rollback is a length reset."""

    fields = ("k", "v")  # the attributes holding the per-slot tensors

    def __init__(self, num_layers, num_slots, max_len, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
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

    def step(self, slots, starts, n_new, backend="sdpa"):
        """A view for one forward: row b writes n_new[b] tokens at positions starts[b]..."""
        return StepView(self, slots, starts, n_new, backend)


class LatentKVCache(KVCache):
    """Multi-head latent attention's cache: one [kv latent ; rope key] row per token and layer
    [layers, slots, max_len, width], read by every head (rollout/embedded/mla.py)."""

    fields = ("latent",)

    def __init__(self, num_layers, num_slots, max_len, width, dtype=torch.float32, device="cpu"):
        self.latent = torch.zeros((num_layers, num_slots, max_len, width), dtype=dtype, device=device)
        self.max_len = max_len
        self.released = None


def make_kv_cache(cfg, num_layers, num_slots, max_len, dtype=torch.float32, device="cpu"):
    """The cache `cfg`'s attention needs: latent rows for MLA, per-head K/V otherwise."""
    if cfg.mla is not None:
        return LatentKVCache(num_layers, num_slots, max_len, cfg.mla.latent_width, dtype, device)
    return KVCache(num_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype, device)


class StepView:
    """The cache as one forward step sees it: which slots, where their new tokens go, the causal mask."""

    def __init__(self, cache, slots, starts, n_new, backend):
        self.cache, self.slots, self.backend = cache, slots, backend
        q_len = int(n_new.max())
        offsets = torch.arange(q_len, device=slots.device)
        self.valid = offsets[None, :] < n_new[:, None]
        self.rows = slots[:, None].expand(-1, q_len)[self.valid]
        self.cols = (starts[:, None] + offsets[None, :])[self.valid]
        self.k_len = int((starts + n_new).max())
        self.starts = starts
        self._mask = None
        lo = int(slots.min())
        # running rows in consecutive slots read the cache through a view instead of a gather
        self.contiguous = bool((slots == torch.arange(lo, lo + len(slots), device=slots.device)).all())
        self.slot_range = slice(lo, lo + len(slots))

    def mask(self, q_len):
        """[B, Q, L] key j visible to the query at offset i: j <= start + i (built once per step)."""
        if self._mask is None:
            q_pos = self.starts[:, None] + torch.arange(q_len, device=self.starts.device)[None, :]
            self._mask = torch.arange(self.k_len, device=self.starts.device)[None, None, :] <= q_pos[:, :, None]
        return self._mask

    def read(self, layer_cache):
        rows = self.slot_range if self.contiguous else self.slots
        return layer_cache[rows, :self.k_len]

    def layers(self, n):
        return [LayerView(self, i) for i in range(n)]


class LayerView:
    """One layer's slice of a `StepView`: writes the new keys/values and attends over the cache."""

    def __init__(self, step, layer):
        self.step, self.layer = step, layer

    def attend(self, q, k, v, positions):
        """q [B,H,Q,D], k/v [B,KV,Q,D] for the new tokens; returns [B,H,Q,D]."""
        return ATTENTION_BACKENDS[self.step.backend](self, q, k, v, positions)

    def exchange_latent(self, entries):
        """Latent cache: write the new tokens' rows entries [B, Q, W]; return (every cached row of
        these slots [B, L, W], key positions [L])."""
        s = self.step
        layer = s.cache.latent[self.layer]
        layer[s.rows, s.cols] = entries[s.valid]
        return s.read(layer), torch.arange(s.k_len, device=entries.device)

    def attend_bqhd(self, q, k, v):
        """The fast path's layout: q [B,Q,H,D], k/v [B,Q,KV,D] -> [B,Q,H,D]."""
        s, cache = self.step, self.step.cache
        if s.backend == "flash":
            return _flash_cached(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None).transpose(1, 2)
        k_layer, v_layer = cache.k[self.layer], cache.v[self.layer]
        k_layer[s.rows, s.cols] = k[s.valid]
        v_layer[s.rows, s.cols] = v[s.valid]
        return gqa_attention(q, s.read(k_layer), s.read(v_layer), s.mask(q.shape[1]))


def _sdpa_cached(view, q, k, v, positions):
    s, cache = view.step, view.step.cache
    k_layer, v_layer = cache.k[view.layer], cache.v[view.layer]
    k_layer[s.rows, s.cols] = k.transpose(1, 2)[s.valid]
    v_layer[s.rows, s.cols] = v.transpose(1, 2)[s.valid]
    keys = k_layer[s.slots, :s.k_len].transpose(1, 2)
    values = v_layer[s.slots, :s.k_len].transpose(1, 2)
    k_positions = torch.arange(s.k_len, device=q.device)
    return sdpa_attention(q, keys, values, positions, k_positions)


def _flash_cached(view, q, k, v, positions):
    """flash-attn path (CUDA only): writes the new K/V into the cache and attends causally."""
    from flash_attn import flash_attn_with_kvcache

    s, cache = view.step, view.step.cache
    out = flash_attn_with_kvcache(
        q.transpose(1, 2), cache.k[view.layer], cache.v[view.layer],
        k=k.transpose(1, 2), v=v.transpose(1, 2), cache_seqlens=s.starts.int(),
        cache_batch_idx=s.slots.int(), causal=True)
    return out.transpose(1, 2)


ATTENTION_BACKENDS = {"sdpa": _sdpa_cached, "flash": _flash_cached}


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn kernels refuse fp32


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

