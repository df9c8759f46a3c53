"""What every external draft (the `model` of the speculative config) shares on the trainer side.

An external draft is a module of its own beside the policy: it reads the policy's residual
stream at a few layers (`AuxHiddenStates`, kept detached by forward hooks on every policy
forward, so the policy's loss and gradients are exactly those without it), steps with its own part
(trainer/optimizer.py: megatron's DDP and optimizer, --draft-lr), averages its gradients over data-parallel
ranks, goes to the rollout under
its wire prefix (`<kind>.<checkpoint name>`) and keeps its weights and optimizer state in a
checkpoint. The draft's module is its kind's (vime/models/draft_kinds.py), loaded from the speculative
config's `model` once the directory is checked against the policy; each kind's trainer (<kind>.py)
adds its loss and what of the policy it reads beside the aux states.

Under pipeline parallelism the layers it reads live on different stages. The draft trains on the
last stage (where the policy's logits are, for a distillation loss): every stage keeps the states
of its own layers for each micro-batch, and once the pipeline has run them all, the earlier stages
send theirs to the last stage point to point (`complete`), which then runs the draft's loss on each
micro-batch; its states are detached, so running it after the policy's backward gives the gradients
it gets inside it. The draft's module exists on every stage, but only the last stage's trains, is
pushed and is saved.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from trainer.distributed import collective_device, dp_group, pp_group, pp_size
from trainer.drafts.base import DraftTrainer
from trainer.model import global_layer_index, is_last_stage
from trainer.optimizer import OptimizerOptions, TrainedPart
from trainer.weights import gather, word_embedding_on_last_stage
from vime.errors import require


class AuxHiddenStates:
    """The policy's residual stream at aux ids (vLLM's numbering: 0 the embedding output, i the
    stream after layer i-1), kept detached as [b, s, H] by hooks on its megatron model (this pipeline
    stage's part of it: the embedding output on the first stage, each layer's on its stage)."""

    def __init__(self, model, aux_layer_ids):
        self.kept = {}
        self.sequence_parallel = model.config.sequence_parallel
        if model.pre_process:  # a later stage's embedding copy embeds the MTP block's tokens, not the trunk's
            model.embedding.register_forward_hook(lambda m, i, out: self._keep(0, out))
        for layer in model.decoder.layers:
            i = global_layer_index(layer)
            if i + 1 in aux_layer_ids:
                layer.register_forward_hook(lambda m, i_, out, key=i + 1: self._keep(key, out))

    def _keep(self, key, out):
        hidden = (out[0] if isinstance(out, tuple) else out).detach()
        if self.sequence_parallel:  # this rank's part of the positions: the whole sequence from every TP rank
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden)
        self.kept[key] = hidden.transpose(0, 1)  # megatron's [s, b, H] -> [b, s, H]

    def take(self):
        """{aux id: [b, s, H]} of the last forward (emptied: each forward's states are read once)."""
        kept, self.kept = self.kept, {}
        return kept

    @staticmethod
    def concat(kept, aux_layer_ids):
        """[b, s, len(ids) * H]: the kept states concatenated in `aux_layer_ids` order."""
        return torch.cat([kept[i] for i in aux_layer_ids], -1)


@dataclass
class DraftInputs:
    """What an external draft's loss reads from one policy forward over a micro-batch (all detached)."""

    aux: Optional[torch.Tensor]  # [b, s, n * H] the policy's states at the draft's aux layers, in order (`complete`)
    tokens: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] 1 on response tokens (the predicted tokens that count)
    share: float  # this micro-batch's share of the step (1 / micro-batches)
    policy_logits: Optional[torch.Tensor] = None  # [b, s, V] for a distillation loss, else None
    embeds: Optional[torch.Tensor] = None  # [b, s, H] the policy's token embeddings (a draft reading them)
    embed_weight: Optional[torch.Tensor] = None  # [V, H] the policy's embedding (a draft storing none)
    head_weight: Optional[torch.Tensor] = None  # [V, H] the policy's output layer (a draft storing none)


def stage_aux_ids(layout, num_layers, aux_layer_ids, stage):
    """The aux ids pipeline `stage` of `layout` keeps (AuxHiddenStates): the embedding output (0) on the
    first stage, the stream after each of its layers that `aux_layer_ids` names."""
    ids = {i + 1 for i in layout.stage_layers(num_layers, stage) if i + 1 in aux_layer_ids}
    return sorted(ids | {0} if stage == 0 else ids)


class ExternalDraftTrainer(DraftTrainer):
    """The external draft of the speculative config's `model`, reading the policy's aux states, with its
    own optimizer."""

    loss_in_pipeline = False  # it reads detached states of every stage: its loss runs after the pipeline
    reads_target_weights = False  # whether its loss reads the policy's embedding and head (`target_weights`)

    def __init__(self, cfg, model, model_cfg):
        super().__init__(cfg)
        spec = cfg.speculative_config
        module = self.kind.load_for_target(spec.model, model_cfg, spec.num_speculative_tokens)
        policy = next(model.parameters())
        self.module = module.to(policy.device, policy.dtype)  # --bf16: bf16 like the policy, fp32 masters in the optimizer
        # each rank's loss is the mean over its micro-batches: the ranks' gradients are averaged
        self.part = TrainedPart(self.module, model.config, OptimizerOptions.of(cfg).replicated(), self.knobs.lr,
                                cfg.weight_decay, cfg.adam_eps, cfg.effective_draft_clip_grad, sum_over_ranks=False,
                                lr_warmup_steps=cfg.draft_lr_warmup_iters)
        self.aux = AuxHiddenStates(model, module.cfg.aux_layer_ids)
        self.model, self.vocab_size = model, model_cfg.vocab_size
        self.hidden_size, self.state_dtype = model_cfg.hidden_size, policy.dtype
        self.stage_ids = [stage_aux_ids(cfg.layout, model_cfg.num_hidden_layers, module.cfg.aux_layer_ids, stage)
                          for stage in range(cfg.layout.pp)]
        self._forwards = []  # this stage's kept states of each forward since the last `complete`

    @classmethod
    def check_config(cls, cfg):
        require(cfg.draft_ttt_steps is None or not cls.kind.block,
                f"--draft-ttt-steps {cfg.draft_ttt_steps} unrolls a chain draft's drafting steps; a {cls.kind.title} "
                "draft trains its whole block in one forward (the block size is the draft's): leave it unset")

    def policy_logits(self, out):
        """The forward's logits, detached, where the loss reads them (else None: not kept)."""
        return out.logits.detach() if self.reads_policy_logits else None

    def target_weights(self):
        """Collective over the pipeline stages: the policy's [V, H] embedding and head as the rollout reads
        them (whole: gathered over TP, the embedding from the first stage when the last keeps no copy),
        detached, on the last stage (None elsewhere)."""
        embed = word_embedding_on_last_stage(self.model)
        if not is_last_stage(self.model):
            return None
        head = gather("output_layer.weight", self.model.output_weight())
        return embed[:self.vocab_size], head[:self.vocab_size]

    # ---- the loss ----------------------------------------------------------------------
    def normaliser(self, batch, num_micro_batches):
        return num_micro_batches

    def inputs(self, out, mb, normaliser):
        return DraftInputs(None, mb.tokens, mb.loss_mask, 1 / normaliser, self.policy_logits(out))

    def policy_inputs(self, kept, dtype, target):
        """What of the policy the kind's loss reads beside its aux states (DraftInputs fields), given the
        forward's kept states {aux id: [b, s, H]} (id 0: the token embeddings), the draft's dtype and the
        policy's (embedding, head) when the kind `reads_target_weights` (else None)."""
        return {}

    # ---- the states of every stage, on the last ----------------------------------------------
    def after_forward(self):
        self._forwards.append(self.aux.take())

    def complete(self, inputs):
        """The last stage's `inputs` with the kept states of every stage and what of the policy the kind
        reads (`policy_inputs`); [] on the other stages."""
        forwards, self._forwards = self._forwards, []
        states = self._states_on_last_stage(forwards, [i.tokens.shape for i in inputs])
        target = self.target_weights() if self.reads_target_weights else None
        if not is_last_stage(self.model):
            return []
        done = []
        for partial, kept in zip(inputs, states):
            aux = AuxHiddenStates.concat(kept, self.module.cfg.aux_layer_ids)
            done.append(dataclasses.replace(partial, aux=aux, **self.policy_inputs(kept, aux.dtype, target)))
        return done

    def _states_on_last_stage(self, forwards, shapes):
        """[{aux id: [b, s, H]}] per forward: the earlier stages send theirs (one flat buffer each, forwards
        in order, ids ascending) to the last stage, which merges them with its own (`shapes`: [b, s] each)."""
        if pp_size() == 1:
            return forwards
        ranks = dist.get_process_group_ranks(pp_group())
        stage, last = ranks.index(dist.get_rank()), len(ranks) - 1
        if stage < last:
            if self.stage_ids[stage]:
                flat = torch.cat([kept[i].reshape(-1) for kept in forwards for i in self.stage_ids[stage]])
                dist.send(flat.to(collective_device()), dst=ranks[last], group=pp_group())
            return forwards
        for src in range(last):
            ids = self.stage_ids[src]
            if not ids:
                continue
            sizes = [b * s * self.hidden_size for b, s in shapes for _ in ids]
            flat = torch.empty(sum(sizes), dtype=self.state_dtype, device=collective_device())
            dist.recv(flat, src=ranks[src], group=pp_group())
            parts = iter(flat.split(sizes))
            for kept, (b, s) in zip(forwards, shapes):
                kept.update({i: next(parts).view(b, s, self.hidden_size) for i in ids})
        return forwards

    def scaled(self, share, total, parts):
        """(loss to backward, reported parts) of a micro-batch whose loss is a mean over it: the
        step's loss is the mean over micro-batches, the reported parts the ranks' mean once summed."""
        reported = share / dist.get_world_size(dp_group())
        return self.cfg.draft_loss_scaling_factor * share * total, [float(x.detach()) * reported for x in parts]

    # ---- sync and checkpoints ----------------------------------------------------------------
    def named_weights(self):
        """(wire name, tensor) of the draft's parameters: `<wire_prefix><checkpoint name>` (the last pipeline
        stage's, the one that trains). Its buffers (EAGLE-3's vocabulary tables) never train: the rollout
        loaded them from the same directory, so only what trains travels, and only that the rollout takes."""
        if not is_last_stage(self.model):
            return
        for name, p in self.module.named_parameters():
            yield self.kind.wire_prefix + name, p.detach()

    def state(self):
        """The draft's weights (under --bf16 its fp32 masters, megatron's `main_param`: a plain fp32 draft for
        export), its optimizer's state and config."""
        weights = {k: v.clone() for k, v in self.module.state_dict().items()}
        weights.update({n: p.main_param.detach().clone() for n, p in self.module.named_parameters()
                        if getattr(p, "main_param", None) is not None})
        return {"draft": weights, "optimizer": self.part.optimizer.state_dict(), "config": self.module.cfg}

    def load_state(self, state):
        self.module.load_state_dict(state["draft"])
        self.part.optimizer.load_state_dict(state["optimizer"])
