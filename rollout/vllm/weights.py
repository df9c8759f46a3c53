"""The weights a vLLM engine serves with: loading them in place, and reading them back for the sync guard.

- Load (--vllm-weight-transfer reload): canonical tensors are renamed to the checkpoint's layout,
  written to a file in shared memory and reloaded in place into the target and the drafter
  (rollout/vllm/worker.py `reload`); the target first, then the drafter (vime/models/vllm_names.py
  `update_rounds`). The NCCL transfer (rollout/vllm/weight_transfer.py) loads the same rounds.
  Handed over in place (an engine on the trainer's device), each round goes to vLLM's worker as
  shared tensors instead of a file (`reload_shared`: CUDA IPC handles on a GPU, no host copy).
- Fingerprint: per canonical tensor, float64 [sum, sum of squares] read back from vLLM's own
  parameters wherever vLLM keeps them (norms, biases, embeddings; everything on GPU). The CPU
  build repacks linear weights into kernel layouts and empties the parameters, so for those
  the fingerprint uses the tensor handed to vLLM's loader (the last one it consumed: a drafter
  that was not reloaded keeps its old value and the guard sees it). `readback_fraction()` is the
  fraction of tensors read back.
- dtype: the engine's (fp32 by default, bf16 under --bf16): the weights go to vLLM in it and every
  sum the guard compares is of values in it: the ones sent, the ones vLLM holds.
"""
import os
import tempfile

import torch

from rollout.vllm import worker as vllm_worker
from vime import weight_sync
from vime.models.draft_kinds import EXTERNAL_DRAFT_PREFIXES, is_draft_name
from vime.models.families import is_mtp_name, to_canonical
from vime.models.vllm_names import checkpoint_names, update_rounds
from vime.precision import dtype_name, held_dtype


class ServedWeights:
    """One engine's weights as vLLM holds them (target and drafter), under canonical names."""

    def __init__(self, llm, checkpoint, model_cfg, dtype, has_draft, method=None):
        self.llm, self.dtype, self.has_draft = llm, dtype, has_draft
        self.method = method  # the speculative method: its drafter's repairs follow a reload
        self.num_layers, self.num_mtp = model_cfg.num_hidden_layers, model_cfg.num_nextn_predict_layers
        self.layout = model_cfg.family if self.num_mtp else None  # its MTP layout renames canonical tensors
        self._init_from_checkpoint(checkpoint)

    def plan(self, keep_draft=True):
        """How a sender cuts an update into this engine's rounds (vllm_names.update_rounds's arguments)."""
        return {"layout": self.layout, "num_hidden_layers": self.num_layers, "num_mtp_layers": self.num_mtp,
                "has_draft": self.has_draft and keep_draft}

    # ---------------------------------------------------------------- loading in place
    def load(self, named_tensors, shared=False):
        """Reload the sent canonical tensors into vLLM: trunk into the target, MTP (or an external
        draft's tensors, sent as `<kind>.<checkpoint name>`) into the drafter; `shared`: each round goes to
        vLLM's worker as shared tensors (where they are), not as a file."""
        # as sent: bf16 under --bf16, bar the weights every part keeps fp32 (vime.precision.held_dtype)
        canonical = {name: t.detach().to(held_dtype(name, self.dtype)).clone() for name, t in named_tensors}
        for kind, named in update_rounds(canonical, self.layout, self.num_layers, self.num_mtp, self.has_draft):
            (self._reload_shared if shared else self._reload)(named, draft=kind != "target")
            self.note_round(kind, {k: tuple(v.shape) for k, v in named.items()})
        for name, t in canonical.items():
            if not is_draft_name(name, self.num_layers) or self.has_draft:
                self.loader_stats[name] = weight_sync.tensor_stats(t)
        self.last_sent = canonical
        self.read_back()

    def note_round(self, kind, shapes):
        """An external draft's tensors (a round named by their wire prefix) are read back under their
        wire names: their shapes unpack them."""
        if kind in EXTERNAL_DRAFT_PREFIXES:
            self.shapes.update({kind + k: shape for k, shape in shapes.items()})

    def _reload(self, named, draft):
        from safetensors.torch import save_file

        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="vime_weights_", suffix=".safetensors", dir=folder)
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in named.items()}, path)
            self.llm.collective_rpc(vllm_worker.reload, args=(path, draft, self.method))
        finally:
            os.unlink(path)

    def _reload_shared(self, named, draft):
        blob = weight_sync.share({k: v.contiguous() for k, v in named.items()})
        self.llm.collective_rpc(vllm_worker.reload_shared, args=(blob, draft, self.method))

    # ---------------------------------------------------------------- reading back
    def _init_from_checkpoint(self, checkpoint):
        """Stats of the checkpoint vLLM loaded at start (what its loader consumed), then read-back."""
        from safetensors.torch import load_file

        raw = {}
        for f in sorted(os.listdir(checkpoint)):
            if f.endswith(".safetensors"):
                raw.update(load_file(os.path.join(checkpoint, f)))
        canonical = to_canonical(raw, self.layout, self.num_layers, self.num_mtp) if self.layout else raw
        if not self.has_draft:  # no drafter: vLLM serves no MTP weights to fingerprint
            canonical = {k: v for k, v in canonical.items() if not is_mtp_name(k, self.num_layers)}
        # what vLLM's loader made of the checkpoint: its values rounded to the engine's dtype
        canonical = {k: v.to(held_dtype(k, self.dtype)) for k, v in canonical.items()}
        self.loader_stats = {k: weight_sync.tensor_stats(v) for k, v in canonical.items()}
        self.shapes = {k: tuple(v.shape) for k, v in
                       checkpoint_names(canonical, self.layout, self.num_layers, self.num_mtp).items()}
        self.last_sent = canonical
        self.read_back()

    def _rpc_args(self, draft):
        return (draft, self.shapes, self.layout, self.num_layers, self.num_mtp, dtype_name(self.dtype))

    def _models(self):
        return [False, True] if self.has_draft else [False]

    def read_back(self):
        """Refresh the stats of every parameter vLLM keeps readable (after each update)."""
        self.readback_stats = {}
        for draft in self._models():
            got = self.llm.collective_rpc(vllm_worker.read_back, args=self._rpc_args(draft))[0]
            self.readback_stats.update({k: torch.tensor(v, dtype=torch.float64) for k, v in got.items()})

    def _stats_by_name(self):
        return {**self.loader_stats, **{k: v for k, v in self.readback_stats.items() if k in self.loader_stats}}

    def fingerprint(self):
        """{"draft": ..., "target": ...} checksums of vLLM's parameters; "draft" is None without a
        drafter (no speculation: nothing in vLLM holds the draft, so there is nothing to compare)."""
        stats = self._stats_by_name()
        draft = {k: v for k, v in stats.items() if is_draft_name(k, self.num_layers)}
        return {"draft": weight_sync.checksum_from_stats(draft) if self.has_draft else None,
                "target": weight_sync.checksum_from_stats({k: v for k, v in stats.items()
                                                           if not is_draft_name(k, self.num_layers)})}

    def digests(self):
        out = {k: weight_sync.digests([(k, v)])[k] for k, v in self.last_sent.items()}
        for draft in self._models():
            got = self.llm.collective_rpc(vllm_worker.digest_back, args=self._rpc_args(draft))[0]
            out.update({k: v for k, v in got.items() if k in out})
        return out

    def readback_fraction(self):
        readable = sum(1 for k in self.loader_stats if k in self.readback_stats)
        return readable / max(len(self.loader_stats), 1)
