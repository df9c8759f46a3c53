"""The trainer's parallel layout and every rule it must satisfy, in one place (pure: no torch, Ray or megatron).

A layout is how the trainer's ranks share the model and the batch, in the flags Megatron and slime
users know:

    --tensor-model-parallel-size TP      every layer's matrices split over TP ranks
    --pipeline-model-parallel-size PP    the decoder layers cut into PP consecutive stages; the first
                                         stage also holds the embedding, the last the final norm, the
                                         output layer and the MTP layers
    --decoder-first-pipeline-num-layers  decoder layers of the first / last stage when the layers do
    --decoder-last-pipeline-num-layers   not split evenly (megatron-core's
                                         num_layers_in_first/last_pipeline_stage); the stages between
                                         share the rest evenly
    --sequence-parallel                  outside attention and the MLPs, activations split along the
                                         sequence over the TP ranks (megatron-core's; needs TP > 1, and
                                         megatron-core splits MoE layers over TP only with it)
    --context-parallel-size CP           each sequence split over CP ranks (attention exchanges keys and
                                         values between them)
    --data-parallel-size DP              replicas of that TP x PP x CP grid, each on its share of the batch
    --expert-model-parallel-size EP      MoE models: the routed experts split over EP ranks of each
                                         pipeline stage's TP x CP x DP ranks (megatron-core's expert groups)
    --expert-tensor-parallel-size ETP    each routed expert's matrices split over ETP ranks (default: TP)

The trainer has TP x PP x CP x DP ranks, numbered as megatron-core numbers them (TP fastest, then CP,
then DP, then PP). `ParallelLayout` holds the sizes and answers where things are (stages' layers, a rank's
data-parallel index); the checks below refuse, in one line each, the layouts that cannot run, before
anything starts: `check()` reads the flags alone, `check_world(ranks)` the ranks a launcher gives,
`check_model(model_cfg)` the model (a `vime.models.hf_format.ModelConfig`). Each parallel
dimension adds its rules to `FLAG_CHECKS` / `MODEL_CHECKS`, not to an if chain; what megatron-core
could split but the trainer does not run yet is in `NOT_RUN_YET`, which `check_split` (the memory plan,
planning ahead) leaves out.
"""
from dataclasses import dataclass
from typing import Optional

from vime.errors import require

# the flag of each layout field, as error lines name them
FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "dp": "--data-parallel-size",
    "ep": "--expert-model-parallel-size",
    "etp": "--expert-tensor-parallel-size",
    "first_stage_layers": "--decoder-first-pipeline-num-layers",
    "last_stage_layers": "--decoder-last-pipeline-num-layers",
    "sp": "--sequence-parallel",
    "cp": "--context-parallel-size",
}
# the config fields (TrainSection, trainer.config.TrainerConfig) each layout field is read from
FIELDS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "dp": "data_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "first_stage_layers": "decoder_first_pipeline_num_layers",
    "last_stage_layers": "decoder_last_pipeline_num_layers",
    "sp": "sequence_parallel",
    "cp": "context_parallel_size",
}


@dataclass(frozen=True)
class ParallelLayout:
    """TP x PP x CP x DP trainer ranks, how the decoder layers split over the pipeline stages, the routed
    experts over EP x ETP ranks of each stage, and whether activations split along the sequence over TP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # None: TP, as megatron-core
    first_stage_layers: Optional[int] = None  # None: the even share
    last_stage_layers: Optional[int] = None
    sp: bool = False
    cp: int = 1

    @classmethod
    def of(cls, section):
        """The layout a config section holds (any object with the `FIELDS` attributes; missing ones default)."""
        defaults = cls()
        return cls(**{name: getattr(section, attr, getattr(defaults, name)) for name, attr in FIELDS.items()})

    def config_fields(self):
        """{config field: value} of the sizes this layout sets apart from one rank's: the fields `of` reads,
        to build a config from it (the others keep the config's defaults)."""
        defaults = ParallelLayout()
        return {attr: getattr(self, name) for name, attr in FIELDS.items()
                if getattr(self, name) != getattr(defaults, name)}

    @property
    def world_size(self):
        """Trainer ranks: TP x PP x CP x DP."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def stage_ranks(self):
        """Ranks of one pipeline stage: TP x CP x DP."""
        return self.tp * self.cp * self.dp

    @property
    def expert_tp(self):
        """Ranks each routed expert's matrices are split over (ETP; TP unless given)."""
        return self.etp if self.etp is not None else self.tp

    @property
    def expert_dp(self):
        """Ranks of a pipeline stage that hold the same routed experts (megatron-core's expert data parallelism)."""
        return self.stage_ranks // (self.ep * self.expert_tp)

    def describe(self):
        """'--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 x --data-parallel-size 1' (and CP)."""
        dims = ("tp", "pp", "cp", "dp") if self.cp > 1 else ("tp", "pp", "dp")
        return " x ".join(f"{FLAGS[k]} {getattr(self, k)}" for k in dims)

    # ---- where things are ------------------------------------------------------------
    def dp_rank(self, rank):
        """The data-parallel index of trainer `rank` (megatron-core's order: TP fastest, then CP, then DP,
        then PP)."""
        return (rank // (self.tp * self.cp)) % self.dp

    def pp_rank(self, rank):
        """The pipeline stage of trainer `rank`."""
        return rank // self.stage_ranks

    def stage_layer_counts(self, num_layers):
        """[decoder layers of each stage], as megatron-core splits them (`check_model` passed)."""
        if self.pp == 1:
            return [num_layers]
        first, last = self.first_stage_layers, self.last_stage_layers
        middle = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        share = rest // middle if middle else 0
        counts = [share] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def stage_layers(self, num_layers, stage):
        """range of the global (0-based) decoder layer indices that pipeline `stage` holds."""
        counts = self.stage_layer_counts(num_layers)
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def stage_of_layer(self, num_layers, layer):
        """The pipeline stage that holds global decoder layer `layer`."""
        return next(s for s in range(self.pp) if layer in self.stage_layers(num_layers, s))

    # ---- checks ------------------------------------------------------------------------
    def check(self):
        """One line for a layout whose flags contradict each other (no model needed)."""
        for rule in FLAG_CHECKS:
            rule(self)

    def check_world(self, ranks, source="the trainer group"):
        """One line when `source` gives `ranks` trainer processes and the layout needs another number."""
        require(ranks == self.world_size,
                f"{source} gives {ranks} trainer ranks, but {self.describe()} needs {self.world_size}: "
                "the ranks must be TP x PP x CP x DP")

    def check_model(self, model_cfg):
        """One line for a layout this model cannot be split into, or the trainer does not run yet
        (`model_cfg`: a ModelConfig)."""
        self.check_split(model_cfg)
        for rule in NOT_RUN_YET:
            rule(self, model_cfg)

    def check_split(self, model_cfg):
        """One line for a layout megatron-core cannot split this model into."""
        self.check()
        for rule in MODEL_CHECKS:
            rule(self, model_cfg)


ONE_RANK = ParallelLayout()  # one trainer process: the whole model, the whole batch


def _architecture(model_cfg):
    return model_cfg.model_family.architectures[0]


# ---- tensor and sequence parallelism ---------------------------------------------------------
def _check_sequence_parallel(layout):
    """Sequence parallelism splits over the TP ranks: there must be more than one."""
    require(not layout.sp or layout.tp > 1, f"{FLAGS['sp']} splits the sequence over the tensor-parallel ranks: use "
            f"it with {FLAGS['tp']} 2 or more, or drop it")


def _check_tensor_parallel(layout, model_cfg):
    """TP must divide the heads, the key/value heads and the vocabulary; MoE layers split over TP with
    sequence parallelism only."""
    tp = layout.tp
    # megatron-core's MoE layer refuses TP > 1 without sequence parallelism (its token dispatcher
    # expects each TP rank to route its own part of the sequence)
    require(tp == 1 or model_cfg.moe is None or layout.sp, f"{FLAGS['tp']} {tp}: megatron-core splits the layers of "
            f"mixture-of-experts models ({_architecture(model_cfg)}) over TP only with sequence parallelism: add "
            f"{FLAGS['sp']}")
    for what, n in (("attention heads", model_cfg.num_attention_heads),
                    ("key/value heads", model_cfg.num_key_value_heads),
                    ("vocabulary size", model_cfg.vocab_size),
                    ("hidden size", model_cfg.hidden_size),  # the MTP layers' eh_proj splits it
                    ("MLP width (intermediate_size)", model_cfg.intermediate_size)):
        require(n % tp == 0, f"{FLAGS['tp']} {tp} does not divide the model's {n} {what}; choose a divisor of {n}")


# ---- expert parallelism -----------------------------------------------------------------------
def _check_expert_flags(layout):
    """EP x ETP must divide a pipeline stage's TP x CP x DP ranks: megatron-core lays the expert groups out inside
    them (each size >= 1 is the flags' range, checked by every command line before a layout is built)."""
    stage = layout.stage_ranks
    cp = f" x {FLAGS['cp']} {layout.cp}" if layout.cp > 1 else ""
    require(stage % (layout.ep * layout.expert_tp) == 0,
            f"{FLAGS['ep']} {layout.ep} x {FLAGS['etp']} {layout.expert_tp} does not divide the {stage} trainer ranks "
            f"of a pipeline stage ({FLAGS['tp']} {layout.tp}{cp} x {FLAGS['dp']} {layout.dp}); choose EP x ETP "
            f"dividing TP x {'CP x ' if cp else ''}DP")


def _check_expert_parallel(layout, model_cfg):
    """EP and ETP against the model: routed experts to split, EP dividing their count, ETP each expert's width."""
    moe = model_cfg.moe
    if moe is None:
        for name, size in (("ep", layout.ep), ("etp", layout.etp)):
            require(size in (None, 1), f"{FLAGS[name]} {size}: {_architecture(model_cfg)} is a dense model with no "
                    "routed experts to split; drop the flag")
        return
    experts, width = moe.n_routed_experts, moe.moe_intermediate_size
    require(experts % layout.ep == 0, f"{FLAGS['ep']} {layout.ep} does not divide the model's {experts} routed "
            f"experts (n_routed_experts); choose a divisor of {experts}")
    require(width % layout.expert_tp == 0, f"{FLAGS['etp']} {layout.expert_tp} does not divide each expert's {width} "
            f"hidden units (moe_intermediate_size); choose a divisor of {width}")


# ---- pipeline parallelism ---------------------------------------------------------------------
def _check_stage_flags(layout):
    """The first/last-stage counts name stages of a pipeline: PP > 1; at PP 2 both would have to add up."""
    for name in ("first_stage_layers", "last_stage_layers"):
        value = getattr(layout, name)
        require(value is None or layout.pp > 1, f"{FLAGS[name]} {value} sets the layers of one of several pipeline "
                f"stages: use it with {FLAGS['pp']} 2 or more, or drop it")


def _suggest_split(num_layers, pp):
    """A --decoder-last-pipeline-num-layers (or -first-) value that makes `num_layers` split over `pp` stages."""
    for flag in (FLAGS["last_stage_layers"], FLAGS["first_stage_layers"]):
        for n in [*range(num_layers // pp, 0, -1), *range(num_layers // pp + 1, num_layers)]:
            rest = num_layers - n
            if rest >= pp - 1 and rest % (pp - 1) == 0:
                return f"{flag} {n}"
    return None


def _check_pipeline_stages(layout, model_cfg):
    """Every stage holds at least one decoder layer (the MTP layers ride on the last stage, beside its
    decoder layers, and make no stage of their own), and the stages split the layers as megatron-core does."""
    pp, n = layout.pp, model_cfg.num_hidden_layers
    if pp == 1:
        return
    mtp = model_cfg.num_nextn_predict_layers or 0
    beside = f" (its {mtp} MTP layer{'s' if mtp > 1 else ''} sit on the last stage and make no stage of their own)"
    require(pp <= n, f"{FLAGS['pp']} {pp} cuts the model into more stages than its {n} decoder layers"
            f"{beside if mtp else ''}; use at most {n}")
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is None and last is None:
        hint = _suggest_split(n, pp)
        require(n % pp == 0, f"{FLAGS['pp']} {pp} does not divide the model's {n} decoder layers into equal stages; "
                f"set the uneven stage's layers, e.g. {hint}")
        return
    given = [f"{FLAGS[k]} {getattr(layout, k)}" for k in ("first_stage_layers", "last_stage_layers")
             if getattr(layout, k) is not None]
    middle = pp - len(given)
    rest = n - (first or 0) - (last or 0)
    what = " and ".join(given)
    if middle == 0:
        require(rest == 0, f"{what} add up to {n - rest}, but the model has {n} decoder layers over "
                f"{FLAGS['pp']} {pp} stages; make them add up to {n}")
        return
    stages = f"the other {middle} pipeline stage{'s' if middle > 1 else ''}"
    require(rest >= 0, f"{what} take {n - rest} decoder layers, more than the model's {n}, and {stages} need at least "
            f"1 each; give them at most {n - middle} together")
    require(rest >= middle and rest % middle == 0,
            f"{what} leave {rest} of the model's {n} decoder layers for {stages}, which must hold an equal number of "
            "at least 1 each")


FLAG_CHECKS = [_check_stage_flags, _check_expert_flags, _check_sequence_parallel]
MODEL_CHECKS = [_check_tensor_parallel, _check_pipeline_stages, _check_expert_parallel]
def _context_parallel_not_run(layout, model_cfg):
    """Context parallelism: planned (the memory plan models it), not run by the trainer."""
    require(layout.cp == 1, f"{FLAGS['cp']} {layout.cp}: megatron-core splits attention over context-parallel ranks "
            "only in Transformer Engine's attention (CUDA), not in the local attention of the CPU build, and the "
            "trainer does not split its sequences for it; the memory plan models it (python -m vime.memory_plan "
            f"--layout ...,cp={layout.cp})")


NOT_RUN_YET = [_context_parallel_not_run]  # splits megatron-core can make of a model that the trainer does not run
