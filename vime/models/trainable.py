"""What megatron-core, as vime builds it (trainer/model.py), can train (pure: no megatron import).

The engine runs every MoE / MLA variant a family's config can state; megatron-core's layers express
fewer. `check_trainable` refuses the others in one line before anything starts: in the driver's
pre-start checks, when the trainer builds its model, and in the memory plan, which lists layouts only
for models the trainer can build.
"""
from vime.errors import require


def check_trainable(model_cfg):
    """One line for a MoE / MLA variant the engine runs but megatron-core's layers cannot express."""
    moe, mla, yarn = model_cfg.moe, model_cfg.mla, model_cfg.rope_yarn
    what = f"the trainer (megatron-core) cannot train this {model_cfg.model_family.architectures[0]} checkpoint"
    if moe is not None:
        require(moe.norm_topk_prob and moe.num_experts_per_tok > 1,
                f"{what}: its router must normalise the top-k weights (norm_topk_prob true, "
                f"num_experts_per_tok > 1; got {moe.norm_topk_prob}, {moe.num_experts_per_tok})")
        require(moe.first_k_dense_replace < model_cfg.num_hidden_layers,
                f"{what}: first_k_dense_replace {moe.first_k_dense_replace} leaves no MoE layer, but the MTP "
                "layers are built like the last decoder layer")
    if mla is not None:
        require(mla.rope_interleave, f"{what}: megatron's MLA rotates interleaved rope channels (rope_interleave "
                "true, as DeepSeek-V3 stores them)")
    if yarn is not None:
        require(mla is not None, f"{what}: megatron applies YaRN only with multi-latent attention")
        require(yarn.attention_factor is None and yarn.truncate,
                f"{what}: megatron's YaRN derives the attention factor from mscale/mscale_all_dim and rounds the "
                "ramp ends; drop attention_factor and truncate from rope_scaling")
