"""The parameters each trainer rank holds under a megatron-core layout, counted from the checkpoint format (pure).

Every tensor of `expected_hf_tensors(cfg)` (hf_format.py) is held by megatron-core in one of three ways
(`HOLDING`): split over the TP ranks (the vocabulary-parallel embedding and output layer, the column-
and row-parallel projections, the dense MLPs and shared experts, the MTP layers' eh_proj), whole on
every TP rank (the RMSNorms, the router and its correction bias), or as a routed expert (an EP rank
holds n_routed_experts / EP of them, each split over ETP ranks). The Transformer-Engine spec (GPUs)
keeps multi-latent attention's two down-projections whole on every TP rank, the local spec (CPU)
splits them (`SPEC_HOLDING`). The router's correction bias is a buffer in megatron-core (no gradient,
no optimizer state; megatron_names.SYNCED_BUFFERS).

Pipeline stages, as megatron-core's GPTModel builds them: the first stage holds the word embedding,
every stage its decoder layers, the last stage the final norm, the output layer and the MTP layers.
With PP > 1 the last stage holds an output layer of its own even when the embedding is tied, and the
MTP layers get a copy of the word embedding there (both kept equal to the first stage's).
"""
import re
from dataclasses import dataclass, field

from vime.models.hf_format import expected_hf_tensors
from vime.models.megatron_names import MOE_LAYER, SYNCED_BUFFERS

SPLIT, WHOLE, EXPERT = "split over TP", "whole on every TP rank", "routed expert"

# the first pattern that matches a canonical name says how megatron-core holds the tensor
HOLDING = (
    (re.compile(r"\.mlp\.experts\.\d+\."), EXPERT),
    (re.compile(r"norm\.weight$"), WHOLE),  # every RMSNorm: layer, final, q/k, MLA latent, MTP
    (re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$"), WHOLE),  # the router
    (re.compile(r""), SPLIT),
)
# where a layer spec holds a tensor otherwise (checked before HOLDING); trainer/model.py's LAYER_SPECS
SPEC_HOLDING = {
    "te": ((re.compile(r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"), WHOLE),),  # TELinear, duplicated
    "local": (),  # ColumnParallelLinear
}
# canonical names of the checkpoint weights megatron-core keeps as buffers
BUFFER_SUFFIXES = tuple(MOE_LAYER[b] for b in SYNCED_BUFFERS)

EMBEDDING, OUTPUT, FINAL_NORM = "word embedding", "output layer", "final norm"


def holding(name, spec):
    """How megatron-core holds canonical tensor `name` under layer spec `spec` ("te" or "local")."""
    for pattern, how in SPEC_HOLDING[spec] + HOLDING:
        if pattern.search(name):
            return how
    raise AssertionError(name)  # HOLDING's last pattern matches every name


@dataclass(frozen=True)
class Held:
    """Elements one rank holds: parameters (of which routed experts') and buffers."""

    params: int = 0
    expert_params: int = 0
    buffers: int = 0

    def __add__(self, other):
        return Held(self.params + other.params, self.expert_params + other.expert_params,
                    self.buffers + other.buffers)

    def __sub__(self, other):
        return Held(self.params - other.params, self.expert_params - other.expert_params,
                    self.buffers - other.buffers)

    @property
    def elements(self):
        return self.params + self.buffers


@dataclass(frozen=True)
class Tally:
    """Elements of one part of the model (a layer, the embedding, ...) by how megatron-core holds them."""

    split: int = 0
    whole: int = 0
    expert: int = 0
    buffers: int = 0

    def add(self, name, numel, spec):
        how = holding(name, spec)
        if name.endswith(BUFFER_SUFFIXES):
            return Tally(self.split, self.whole, self.expert, self.buffers + numel)
        return Tally(self.split + numel * (how == SPLIT), self.whole + numel * (how == WHOLE),
                     self.expert + numel * (how == EXPERT), self.buffers)

    def on_rank(self, tp, ep, etp):
        """What one rank of a TP x EP x ETP layout holds of this part."""
        experts = _exact(self.expert, ep * etp, "routed experts over EP x ETP")
        return Held(params=_exact(self.split, tp, "TP-split tensors") + self.whole + experts,
                    expert_params=experts, buffers=self.buffers)


def _exact(numel, parts, what):
    if numel % parts:  # ParallelLayout.check_split refuses such layouts first
        raise ValueError(f"{numel} elements of {what} do not split into {parts} parts")
    return numel // parts


def part_of(name, num_hidden_layers):
    """The model part a canonical name belongs to: EMBEDDING, OUTPUT, FINAL_NORM, ("layer", i) or ("mtp", k)."""
    top = {"model.embed_tokens.weight": EMBEDDING, "lm_head.weight": OUTPUT, "model.norm.weight": FINAL_NORM}
    if name in top:
        return top[name]
    index = int(name.split(".")[2])  # model.layers.{i}.
    return ("layer", index) if index < num_hidden_layers else ("mtp", index - num_hidden_layers)


def part_tallies(cfg, num_mtp_layers, spec="te"):
    """{model part: Tally} of `cfg` with `num_mtp_layers` MTP layers; a tied output layer is the embedding's."""
    tallies = {}
    for name, expected in expected_hf_tensors(cfg, num_mtp_layers).items():
        part = part_of(name, cfg.num_hidden_layers)
        numel = 1
        for d in expected.shape:
            numel *= d
        tallies[part] = tallies.get(part, Tally()).add(name, numel, spec)
    if cfg.tie_word_embeddings:
        tallies[OUTPUT] = tallies[EMBEDDING]
    return tallies


@dataclass(frozen=True)
class Stage:
    """What one rank of a pipeline stage holds: its decoder layers, the other parts, trunk and MTP elements."""

    layers: range
    parts: tuple  # names of the parts besides decoder layers (EMBEDDING, ..., "MTP layer 0")
    trunk: Held
    mtp: Held = field(default_factory=Held)

    @property
    def total(self):
        return self.trunk + self.mtp


class RankParams:
    """The elements each rank of a layout holds, stage by stage, for one model (see module docstring)."""

    def __init__(self, cfg, num_mtp_layers, spec="te"):
        self.cfg, self.num_mtp_layers = cfg, num_mtp_layers
        self.tallies = part_tallies(cfg, num_mtp_layers, spec)
        self._prefixes = {}

    def held(self, part, layout):
        return self.tallies[part].on_rank(layout.tp, layout.ep, layout.expert_tp)

    def _layer_prefix(self, layout):
        """Held of decoder layers 0..i-1 on one rank of `layout`, for i = 0..L (a stage's is a difference)."""
        key = (layout.tp, layout.ep, layout.expert_tp)
        if key not in self._prefixes:
            sums = [Held()]
            for i in range(self.cfg.num_hidden_layers):
                sums.append(sums[-1] + self.held(("layer", i), layout))
            self._prefixes[key] = sums
        return self._prefixes[key]

    def end_parts(self, layout, first, last):
        """(trunk Held, MTP Held, part names) of the parts besides decoder layers on a stage."""
        trunk, mtp, names = Held(), Held(), []
        if first:
            trunk, names = trunk + self.held(EMBEDDING, layout), names + [EMBEDDING]
        if last:
            trunk, names = trunk + self.held(FINAL_NORM, layout), names + [FINAL_NORM]
            if layout.pp > 1 or not self.cfg.tie_word_embeddings:  # else the embedding is the output layer
                trunk, names = trunk + self.held(OUTPUT, layout), names + [OUTPUT]
            for k in range(self.num_mtp_layers):
                mtp, names = mtp + self.held(("mtp", k), layout), names + [f"MTP layer {k}"]
            if self.num_mtp_layers and not first:  # the MTP layers' copy of the word embedding
                trunk, names = trunk + self.held(EMBEDDING, layout), names + [f"{EMBEDDING} copy (MTP)"]
        return trunk, mtp, tuple(names)

    def stage(self, layout, start, count, first, last):
        """The Stage of decoder layers start..start+count-1 on one rank of `layout` (first / last: which end)."""
        prefix = self._layer_prefix(layout)
        trunk, mtp, names = self.end_parts(layout, first, last)
        return Stage(range(start, start + count), names, trunk + prefix[start + count] - prefix[start], mtp)

    def stages(self, layout):
        """[Stage] of `layout` (a vime.parallel_layout.ParallelLayout that `check_split` accepted), first to last."""
        counts = layout.stage_layer_counts(self.cfg.num_hidden_layers)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [self.stage(layout, start, n, i == 0, i == len(counts) - 1)
                for i, (start, n) in enumerate(zip(starts, counts))]

    def totals(self):
        """(trunk Held, MTP Held) of the whole model, every parameter once (a tied output layer is the embedding)."""
        whole = {part: tally.on_rank(1, 1, 1) for part, tally in self.tallies.items()}
        tied = self.cfg.tie_word_embeddings
        trunk = sum((h for p, h in whole.items() if not _is_mtp(p) and not (tied and p == OUTPUT)), Held())
        mtp = sum((h for p, h in whole.items() if _is_mtp(p)), Held())
        return trunk, mtp


def _is_mtp(part):
    return isinstance(part, tuple) and part[0] == "mtp"
