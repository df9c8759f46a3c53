"""The megatron-core model (+MTP) of every family, and the only code that knows megatron's
private names. The family (vime/models/families.py) sets the trunk options (q/k/v
bias, q/k norm) and which hidden state the first MTP layer reads.

`build_model(model_cfg, mtp_num_layers, ...)` builds a `VimeGPTModel`: a `GPTModel` whose
`_postprocess` returns the policy logits (TP-gathered, [b, s, V]) and the inputs the MTP
block needs, instead of running megatron's own MTP loss. The trainer then calls
`mtp_logits(...)`, which runs the MTP block on detached trunk outputs by default, and adds
the MTP loss itself (docs/design.md#the-draft-trains-on-detached-policy-states).
"""
import contextlib
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp.reuse import reuse_attention_mask, reuse_positions
from vime.models.activations import RecomputePlan, recompute_problem
from vime.models.megatron_names import MTP_INNER_LAYER
from vime.models.trainable import check_trainable
from vime.parallel_layout import ONE_RANK


@dataclass
class ForwardOutput:
    """What one forward hands to the losses: logits and the MTP block's inputs."""

    logits: torch.Tensor  # [b, s, V] full vocabulary
    hidden: torch.Tensor  # [s, b, H] trunk output as the first MTP layer reads it (family-dependent)
    mtp_inputs: dict
    token_mask: torch.Tensor = None  # [b, s] bool, False on padding: the positions MoE routers count


NO_RECOMPUTE = RecomputePlan()  # megatron's activation recompute (vime/models/activations.py): none


def check_recompute(layout, model_cfg, recompute):
    """One line for a recompute megatron-core cannot run over `layout`'s stages of `model_cfg`'s layers."""
    from vime.errors import require

    counts = layout.stage_layer_counts(model_cfg.num_hidden_layers)
    problem = recompute_problem(counts, recompute)
    require(problem is None, problem)


def _use_transformer_engine():
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _block_spec(config, use_transformer_engine):
    """Per-layer specs from the config: dense and MoE layers as `moe_layer_freq` says; MLA's core
    attention replaced where the local spec's cannot take its head widths (cpu_patches.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine,
                                       normalization="RMSNorm")
    if config.multi_latent_attention and not use_transformer_engine:
        from trainer.cpu_patches import latent_core_attention

        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = latent_core_attention()
    return block


def _local_spec(config):
    return _block_spec(config, use_transformer_engine=False)


def _te_spec(config):
    return _block_spec(config, use_transformer_engine=True)


LAYER_SPECS = {"local": _local_spec, "te": _te_spec}


def spec_name():
    """'te' with CUDA and Transformer Engine present, else 'local' (CPU / gloo)."""
    return "te" if _use_transformer_engine() else "local"


def transformer_config(model_cfg, mtp_num_layers, layout=ONE_RANK, params_dtype=torch.float32, recompute=NO_RECOMPUTE):
    """megatron TransformerConfig of `model_cfg` (RMSNorm, RoPE, SwiGLU; GQA with the config's q/k/v
    bias and q/k norm, or MLA; dense MLPs, or MoE from `first_k_dense_replace` on), split as `layout` says
    (a MoE model's routed experts over its EP ranks, each expert over its ETP ranks; activations along the
    sequence over TP under sequence parallelism), recomputing activations as `recompute` says."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_trainable(model_cfg)
    options = dict(
        num_layers=model_cfg.num_hidden_layers, hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.intermediate_size, num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_key_value_heads, kv_channels=model_cfg.head_dim,
        layernorm_epsilon=model_cfg.rms_norm_eps, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, context_parallel_size=layout.cp, sequence_parallel=layout.sp,
        mtp_num_layers=mtp_num_layers or None,
        mtp_loss_scaling_factor=0.0, use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        add_qkv_bias=model_cfg.qkv_bias, qk_layernorm=model_cfg.qk_norm,
        **pipeline_options(layout, params_dtype), **recompute.transformer_config(),
    )
    if model_cfg.moe is not None:
        options.update(moe_options(model_cfg), expert_model_parallel_size=layout.ep,
                       expert_tensor_parallel_size=layout.etp)
    if model_cfg.mla is not None:
        options.update(mla_options(model_cfg))
        return MLATransformerConfig(**options)
    return TransformerConfig(**options)


def pipeline_options(layout, params_dtype):
    """TransformerConfig options of the pipeline stages (harmless at one stage): uneven first/last stages;
    stage outputs sent in the compute dtype, all micro-batches of a call of one shape (megatron's
    all-gather token dispatcher, the MoE one that runs on CPU, refuses shapes that vary: the trainer
    pads a short last micro-batch, trainer/trainer.py `_run`); and the trainer's micro-batch losses taken
    as they are, since each already is its share of the step's token mean (the schedule would otherwise
    divide it by the micro-batch count)."""
    return dict(num_layers_in_first_pipeline_stage=layout.first_stage_layers,
                num_layers_in_last_pipeline_stage=layout.last_stage_layers, pipeline_dtype=params_dtype,
                calculate_per_token_loss=True)


# megatron's token dispatcher per device: all-to-all sends each token only to its experts' ranks, but
# assumes CUDA; the all-gather one (every rank sees the ETP x EP group's tokens) runs anywhere
TOKEN_DISPATCHERS = {"cuda": "alltoall", "cpu": "allgather"}


def moe_options(model_cfg):
    """TransformerConfig options of the MoE layers (SequentialMLP experts, the device's token
    dispatcher; the router's sigmoid + expert bias + group-limited choice as vime.models.moe_routing
    does it)."""
    moe = model_cfg.moe
    grouped = moe.n_group > 1
    return dict(
        num_moe_experts=moe.n_routed_experts, moe_ffn_hidden_size=moe.moe_intermediate_size,
        moe_router_topk=moe.num_experts_per_tok, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_num_groups=moe.n_group if grouped else None,
        moe_router_group_topk=moe.topk_group if grouped else None,
        moe_router_topk_scaling_factor=moe.routed_scaling_factor, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=(moe.n_shared_experts * moe.moe_intermediate_size
                                             if moe.n_shared_experts else None),
        moe_shared_expert_overlap=False, moe_layer_freq=[int(moe.is_moe_layer(i))
                                                         for i in range(model_cfg.num_hidden_layers)],
        moe_token_dispatcher_type=TOKEN_DISPATCHERS["cuda" if torch.cuda.is_available() else "cpu"],
        moe_grouped_gemm=False, moe_permute_fusion=False,
    )


def mla_options(model_cfg):
    """MLATransformerConfig options: the latent sizes, and YaRN (with its mscale) or plain RoPE."""
    mla, yarn = model_cfg.mla, model_cfg.rope_yarn
    options = dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        rotary_base=model_cfg.rope_theta, add_qkv_bias=False,
        qk_layernorm=True,  # MLA's q/kv latent norms (q_a_layernorm, kv_a_layernorm)
        rope_type="rope" if yarn is None else "yarn", apply_rope_fusion=False,
    )
    if yarn is not None:
        options.update(rotary_scaling_factor=yarn.factor,
                       original_max_position_embeddings=yarn.original_max_position_embeddings,
                       beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale,
                       mscale_all_dim=yarn.mscale_all_dim)
    return options


def _import_gpt_model():
    from megatron.core.models.gpt import GPTModel

    return GPTModel


class _Lazy:
    """Defers subclassing GPTModel until megatron is imported (after the CPU patches)."""

    cls = None


def _vime_gpt_model_class():
    if _Lazy.cls is not None:
        return _Lazy.cls
    GPTModel = _import_gpt_model()

    class VimeGPTModel(GPTModel):
        """GPTModel whose postprocess yields policy logits; the MTP block is run by the trainer."""

        def __init__(self, *args, family, **kwargs):
            super().__init__(*args, **kwargs)
            self.family = family
            self._pre_norm_hidden = None
            if family.mtp_reads_pre_norm_hidden and self.mtp_process:
                # the final norm's input is the trunk state MiMo's MTP layer reads
                self.decoder.final_layernorm.register_forward_hook(self._keep_pre_norm_hidden)

        def _keep_pre_norm_hidden(self, module, inputs, output):
            self._pre_norm_hidden = inputs[0]

        def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                         rotary_pos_cos, rotary_pos_sin, attention_mask=None, packed_seq_params=None,
                         sequence_len_offset=None, **unused):
            if not self.post_process:  # a stage before the last: its output goes on to the next stage
                return hidden_states
            logits = self._logits(hidden_states, self.output_weight())
            mtp_inputs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                              rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                              rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                              sequence_len_offset=sequence_len_offset)
            mtp_hidden = self._pre_norm_hidden if self._pre_norm_hidden is not None else hidden_states
            self._pre_norm_hidden = None
            return ForwardOutput(logits=logits, hidden=mtp_hidden, mtp_inputs=mtp_inputs)

        def output_weight(self):
            if self.share_embeddings_and_output_weights:
                return self.shared_embedding_or_output_weight()
            return self.output_layer.weight

        def _logits(self, hidden_states, weight):
            logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=True)
            return logits.transpose(0, 1).float()

        def mtp_logits(self, out, detach_trunk=True, depths=None, reuse_attention="drafter", first=0):
            """[b, s - first, V] logits of every MTP depth, of positions `first`.. (the layers still read every
            position; only the projection onto the vocabulary skips the first ones, which a loss that never
            counts them need not pay for). detach_trunk: the MTP loss reaches only mtp.*

            Up to the layer count this is megatron's MTP block forward (its layer loop, run
            here so the last layer can repeat). Depths past it (--mtp-train-depths) reuse the
            last layer, as the drafter does for k > layers, attending as `reuse_attention`
            says (mtp/reuse.py REUSE_ATTENTION): `drafter` exactly as the drafter runs the reused step (one
            position further, over the layer's own entries before it: mtp/reuse.py), with its
            previous output detached as an input; `megatron` chained as megatron chains layers
            (its own output at t and token t+d, its own attention context at position t)."""
            hidden = out.hidden.detach() if detach_trunk else out.hidden
            if detach_trunk and self.config.recompute_granularity == "full":
                # megatron recomputes an MTP layer through a reentrant checkpoint, whose output requires grad only
                # if an input does: with every input detached, the layer's weights would get no gradient
                hidden.requires_grad_()

            def embed(input_ids, position_ids, zero_first=True):
                emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
                emb = emb.detach() if detach_trunk else emb
                if zero_first and self.family.mtp_zero_embedding_at_position_0 and holds_first_position(self.config):
                    # [s, b, h], rows start at position 0 (no packing): sequence index 0 is the
                    # pair (hidden at position 0, next token) that MiMo's drafter sees without a token
                    emb = torch.cat([torch.zeros_like(emb[:1]), emb[1:]])
                return emb

            inputs = dict(out.mtp_inputs)
            input_ids, position_ids = inputs.pop("input_ids"), inputs.pop("position_ids")
            weight = self.output_weight()
            weight = weight.detach() if detach_trunk else weight
            layers = self.mtp_layer_per_depth(depths)
            chained = len(self.mtp.layers) if reuse_attention == "drafter" else len(layers)
            logits = []
            for layer in layers[:chained]:
                base = (hidden, input_ids, position_ids)  # the last chained layer's inputs
                # each layer shifts the tokens (and positions) one further, as in megatron's block
                depth_mask = shifted_token_mask(out.token_mask, len(logits) + 1)
                with counting_tokens(routers(layer), [depth_mask]):
                    hidden, input_ids, position_ids = layer(input_ids=input_ids, position_ids=position_ids,
                                                            hidden_states=hidden, embedding=embed, **inputs)
                logits.append(self._logits(hidden[first:], weight))
            if len(layers) > chained:
                for hidden in self._drafter_reuse_steps(layers[-1], base, hidden, len(layers) - chained, embed,
                                                        out.token_mask):
                    logits.append(self._logits(hidden[first:], weight))
            return logits

        def _drafter_reuse_steps(self, layer, base, output, steps, embed, token_mask=None):
            """Outputs [s, b, h] of `steps` reuse steps of the last MTP layer, each exactly as the
            drafter runs it (mtp/reuse.py): block 0 is the layer's chained run (inputs `base`,
            output `output`), block m reads block m-1's output (detached) and token t+L+m."""
            from megatron.core.transformer.multi_token_prediction import roll_tensor

            chained = len(self.mtp.layers)

            hidden_in, input_ids, position_ids = base
            input_ids, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=layer.cp_group)
            blocks = [(hidden_in, embed(input_ids, position_ids))]
            s = hidden_in.shape[0]
            for m in range(1, steps + 1):
                input_ids, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=layer.cp_group)
                blocks.append((output.detach(), embed(input_ids, position_ids, zero_first=False)))
                n = len(blocks)
                positions = reuse_positions(s, n, hidden_in.device)
                mask = reuse_attention_mask(s, n, hidden_in.device)[None, None]
                block_masks = [shifted_token_mask(token_mask, chained + b) for b in range(n)]
                with _latent_rope_at(layer, positions) as own_rope, counting_tokens(routers(layer), block_masks):
                    # MLA rotates inside its attention (own_rope); the others take the table here
                    rotary = None if own_rope else self.rotary_pos_emb.get_emb(s + n)[positions]
                    output = layer._proj_and_transformer_layer(
                        hidden_states=torch.cat([h for h, _ in blocks]),
                        decoder_input=torch.cat([e for _, e in blocks]),
                        attention_mask=mask, rotary_pos_emb=rotary)[(n - 1) * s:]
                yield output

        def mtp_layer_per_depth(self, depths=None):
            """The MTP layer of each draft depth: layer d-1 for d <= layers, then the last one."""
            layers = list(self.mtp.layers)
            depths = len(layers) if depths is None else depths
            return [layers[min(d, len(layers) - 1)] for d in range(depths)]

    _Lazy.cls = VimeGPTModel
    return VimeGPTModel


@contextlib.contextmanager
def _latent_rope_at(mtp_layer, positions):
    """Under multi-latent attention, make the MTP layer's attention rotate row i at `positions[i]`
    (it computes its rope table itself, for rows 0..n-1); yields whether it did. Others: no change."""
    attention = getattr(mtp_layer, MTP_INNER_LAYER).self_attention
    if not getattr(attention.config, "multi_latent_attention", False):
        yield False
        return
    rope = attention.rotary_pos_emb

    def at_positions(*args, **kwargs):
        table = rope.get_emb(int(positions.max()) + 1)  # YaRN: (table, mscale)
        return (table[0][positions], table[1]) if isinstance(table, tuple) else table[positions]

    rope.forward = at_positions
    try:
        yield True
    finally:
        del rope.forward  # the class's own again


def build_model(model_cfg, mtp_num_layers, layout=ONE_RANK, seed=1234, params_dtype=torch.float32,
                recompute=NO_RECOMPUTE):
    """A VimeGPTModel for `model_cfg` (a ModelConfig) on this rank's shard of `layout`, its parameters in
    `params_dtype` (bf16: cast as megatron's Float16Module casts its module; the fp32 master weights
    live in megatron's optimizer, trainer/optimizer.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    layout.check_model(model_cfg)
    check_recompute(layout, model_cfg, recompute)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = transformer_config(model_cfg, mtp_num_layers, layout, params_dtype, recompute)
    name = spec_name()
    layer_spec = LAYER_SPECS[name](config)
    # this stage's layers (megatron builds the MTP block on the last stage only, and None elsewhere)
    mtp_spec = (get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=name == "te")
                if mtp_num_layers else None)
    model = _vime_gpt_model_class()(
        config=config, transformer_layer_spec=layer_spec, vocab_size=model_cfg.vocab_size,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        max_sequence_length=model_cfg.max_position_embeddings, mtp_block_spec=mtp_spec,
        position_embedding_type="rope", rotary_base=model_cfg.rope_theta,
        rotary_percent=model_cfg.partial_rotary_factor,
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings, family=model_cfg.model_family,
    )
    if model_cfg.rope_llama3 is not None:
        _scale_rope_as_llama3(model, model_cfg.rope_llama3)
    # megatron creates most parameters in params_dtype; the norms' weights come from torch
    # modules in fp32, so the whole module is cast, exactly as Float16Module does (module.bfloat16())
    model = model.to(params_dtype)
    for router in routers(model):  # megatron keeps the expert bias fp32, but only from the first forward
        router._maintain_float32_expert_bias()  # on: before it the sync's bucket layout would take it bf16
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def _scale_rope_as_llama3(model, scaling):
    """Llama 3's frequency scaling with the config's own factors: megatron's `rope_scaling` flag fixes
    low/high_freq_factor 1/4 and an original context of 8192, but its `_apply_scaling` takes them all,
    so the inverse frequencies built unscaled are rescaled by it once, before any forward."""
    import dataclasses

    rope = model.rotary_pos_emb
    rope.inv_freq = rope._apply_scaling(rope.inv_freq, **dataclasses.asdict(scaling))


def routers(model):
    """The MoE routers of `model` (decoder and MTP layers) that carry an expert bias."""
    return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]


@torch.no_grad()
def update_expert_biases(model, rate):
    """Auxiliary-loss-free balancing after an optimiser step: each router's expert bias moves by `rate`
    towards balance over the tokens it routed in training forwards since the last update (megatron
    counts them in `local_tokens_per_expert`), summed over the ranks that route different tokens (data-parallel,
    and under sequence parallelism the TP ranks); the counts restart.
    Returns [(router's module name, tokens per expert)] as counted."""
    from trainer.distributed import routed_tokens_sum
    from vime.models.moe_routing import update_expert_bias

    names = {m: n for n, m in model.named_modules()}
    counted = []
    for router in routers(model):
        load = routed_tokens_sum(router.local_tokens_per_expert, model.config.sequence_parallel)
        if rate:
            update_expert_bias(router.expert_bias, load, rate)
        router.local_tokens_per_expert.zero_()
        counted.append((names[router], load))
    return counted


def causal_mask(seq_len, device=None):
    """megatron's attention mask convention: True = masked out."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def forward(model, tokens, token_mask=None):
    """ForwardOutput of `tokens` [b, s] (right-padded; positions 0..s-1) on the last pipeline stage; on a
    stage before it, the hidden states [s, b, H] it hands on (its input: what the previous stage handed
    on, set by the pipeline schedule). `token_mask` [b, s] (False on padding) keeps padding out of the
    MoE routers' load counts, here and in the MTP block after it."""
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    with counting_tokens(routers(model.decoder), [token_mask]):
        out = model(tokens, positions, causal_mask(seq, tokens.device))
    if isinstance(out, ForwardOutput):
        out.token_mask = token_mask
    return out


def is_last_stage(model):
    """Whether `model` is the last pipeline stage (the one with the output layer, the losses, the MTP block)."""
    return model.post_process


def global_layer_index(layer):
    """The 0-based index in the whole model of a decoder layer of this stage (megatron numbers them from 1)."""
    return layer.layer_number - 1


def named_weights(model, copies=False):
    """(megatron name, tensor) of every weight this stage holds (its parameters and the buffers that are
    checkpoint weights), decoder layers named by their index in the whole model, as a one-stage model
    names them. A later stage's copies of the first stage's word embedding (`embedding_copy_names`) are
    the first stage's weight: left out, or with `copies` named as it (to be loaded like it)."""
    from vime.models.megatron_names import is_synced_buffer

    global_index = [global_layer_index(layer) for layer in model.decoder.layers]
    copy_of = embedding_copy_names(model)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if is_synced_buffer(n))]
    for name, tensor in tensors:
        if name in copy_of:
            if copies:
                yield copy_of[name], tensor
        else:
            yield _global_layer_name(name, global_index), tensor


_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _global_layer_name(name, global_index):
    """`name` with a decoder layer's local index (its place in this stage) replaced by its global one."""
    m = _DECODER_LAYER.match(name)
    return f"decoder.layers.{global_index[int(m.group(1))]}.{m.group(2)}" if m else name


WORD_EMBEDDING = "embedding.word_embeddings.weight"


def last_stage_keeps_word_embedding(model):
    """Whether the last pipeline stage of `model`'s pipeline (any stage may ask) holds a copy of the word
    embedding: for the MTP block, or as a tied output layer (`embedding_copy_names`)."""
    return bool(model.config.mtp_num_layers) or model.share_embeddings_and_output_weights


def embedding_copy_names(model):
    """{name: the weight it copies} of this stage's copies of the first stage's word embedding: a later
    stage keeps one for the MTP block, or as a tied output layer (megatron's
    `setup_embeddings_and_output_layer`; with both, that stage's own output layer is unused and copies it
    too). megatron's finalize_model_grads sums the gradients of the copies and of the first stage's embedding
    (trainer/optimizer.py), so that every copy takes the same steps."""
    if model.pre_process:
        return {}
    copies = {}
    if model.post_process and model.mtp_process:
        copies[WORD_EMBEDDING] = WORD_EMBEDDING
    if model.post_process and model.share_embeddings_and_output_weights:
        copies["output_layer.weight"] = WORD_EMBEDDING
    return copies


def shifted_token_mask(token_mask, shift):
    """[b, s]: whether position j's token j + `shift` is a real one (the token an MTP layer at depth
    `shift` reads beside the state at j); past the row's end it is not."""
    if token_mask is None:
        return None
    past_end = torch.zeros_like(token_mask[:, :shift])
    return torch.cat([token_mask[:, shift:], past_end], dim=1)


def local_positions(config, t):
    """The part of `t` ([s, ...], positions first) this rank's layers see: under sequence parallelism megatron
    splits the sequence evenly over the TP ranks (outside attention), else all of it."""
    if not config.sequence_parallel:
        return t
    from trainer.distributed import tp_rank_and_size

    rank, size = tp_rank_and_size()
    return t.chunk(size)[rank]


def holds_first_position(config):
    """Whether this rank's part of the sequence (`local_positions`) starts at position 0."""
    from trainer.distributed import tp_rank_and_size

    return not config.sequence_parallel or tp_rank_and_size()[0] == 0


@contextlib.contextmanager
def counting_tokens(router_modules, block_masks):
    """While the routers run over the sequence-concatenated blocks of `block_masks` (each [b, s]) in a forward
    with grad enabled (a training step's), their expert-bias load counts only the positions True there
    (trainer/cpu_patches.py applies it; a None mask counts every position, as megatron does). Outside it,
    in an evaluation or in the backward pass's recompute of a layer, they count nothing."""
    if not router_modules:
        yield
        return
    counted = None
    if not any(m is None for m in block_masks):
        # megatron's routers see [s, b] flattened: position-major, then the row (this rank's positions)
        config = router_modules[0].config
        counted = torch.cat([local_positions(config, m.transpose(0, 1)) for m in block_masks]).reshape(-1)
    training = torch.is_grad_enabled()
    for router in router_modules:
        router.counted_tokens, router.counting = counted, training
    try:
        yield
    finally:
        for router in router_modules:
            router.counted_tokens, router.counting = None, False


def is_mtp_param(name):
    return name.startswith("mtp.")
