"""The embedded inference engine: continuous batching over a slot KV cache, exact log-probs.

One mutable `Request` per sample flows through the loop. Each iteration prefills newly
admitted requests into free slots (one ragged forward), then runs one verify forward for
the running ones: the last token plus that request's drafts (none for plain decoding, so
plain and speculative decoding share this path and differ only in the proposer). A prompt
that several admitted requests share (a GRPO group) is prefilled once and its KV entries
copied into the other slots, as vLLM's prefix caching does (a GRPO batch prefills each prompt once,
not once per sample).
Accepted tokens are appended, rejected KV entries are dropped by resetting the slot
length. How many tokens get drafted for the next step is the k policy's choice
(rollout/embedded/spec_policy.py: fixed, vLLM's batch-size schedule, or adaptive); the engine times
each verify and draft phase and reports it to the policy. Sampling is driven by per-request generators, so a request's output does not
depend on which others share the batch.

The uniform that decides output position t is drawn for t, not for the step that reaches it
(`Request.position_uniforms`): plain sampling emits inverse-CDF(p_t, U[t]), and strict
verification emits the same token (it accepts a draft only where it equals that sample), so
with the same seed speculative sampling reproduces plain sampling token for token, at any k.
A run with speculation on and one with it off then roll out the same responses, which makes
their timings comparable step by step (the drift benchmark).

Every forward over the caches is a static step (rollout/embedded/steps.py): its shape is settled
on the host from the requests' lengths, nothing inside it waits for the device, and on CUDA each
decode / verify shape (and each draft step's) runs as a captured CUDA graph, rows padded up to a
batch bucket; on CPU, or with `enforce_eager`, the same step functions run eagerly at the batch's
own shape. Prefill, and every step of a mixture-of-experts model (its expert dispatch and route
recording follow the routing's data), always run eagerly.
"""
import time
from collections import deque
from dataclasses import dataclass

import torch

from vime.models.hf_format import load_hf_checkpoint
from mtp.rejection import verify
from mtp.sampling import processed_logprobs
from rollout.embedded.fast_model import FastForward
from rollout.embedded.kv_cache import FLASH_QUERY_ROOM, make_kv_cache, pick_attention_backend
from rollout.embedded.model import CausalLMWithMTP
from rollout.embedded.padding import pad_token_rows
from rollout.embedded.proposers import TargetForward, Proposer
from rollout.embedded.proposers.drafting import DRAFT_FAMILY
from rollout.embedded.spec_policy import FixedK, StepRecord
from rollout.embedded.steps import StepRunner, device_tensor
from rollout.sampling_params import request_seed
from vime.errors import UserError, require
from vime.models.routing_replay import RouteTable
from vime.precision import held_dtype


@dataclass
class EngineConfig:
    """How the engine runs: batch slots, context length, device/dtype, kernels and the verify rule."""

    max_batch_size: int = 64
    max_len: int = None  # context length in tokens; default: the model's max_position_embeddings
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    attention_backend: str = "auto"  # auto | sdpa | flash
    linear_backend: str = "auto"  # auto | mkldnn | dense (rollout/embedded/linear.py)
    rejection_sample_method: str = "probabilistic"
    # compute a prompt shared by several requests of one admission (a GRPO group) once, copying
    # its KV entries (vLLM's prefix caching does the same for shared prompts)
    share_prompt_prefill: bool = True
    # keep the running requests in slots 0..n-1 (move the last ones into the holes finished ones
    # leave), so attention reads the cache through a view instead of gathering it every step
    compact_slots: bool = True
    synthetic_acceptance_rates: tuple = None  # conditional, per draft position (spec_config.synthetic_position_rates)
    # run every step eagerly, also on CUDA: no CUDA graphs (vLLM's enforce_eager)
    enforce_eager: bool = False
    # pad a step's rows up to a batch bucket and its keys up to a length bucket (None: exactly when
    # steps run as CUDA graphs, which need fixed shapes; True on CPU shows padding changes nothing)
    pad_to_buckets: bool = None
    compile_steps: bool = False  # torch.compile each graphed step before capturing it (CUDA)


class Request:
    """One sample being generated: its Sample record plus the engine's per-request state."""

    def __init__(self, sample, sampling, generator):
        self.sample, self.sampling, self.generator = sample, sampling, generator
        # one uniform per output position for verification, one per step start for a residual
        # draw; drafts draw from the generator's stream after these (`uniforms`)
        self._position_u = torch.rand(sampling.max_new_tokens, generator=generator)
        self._residual_u = torch.rand(sampling.max_new_tokens, generator=generator)
        self.slot = -1
        self.num_cached = 0  # target KV entries that hold accepted tokens
        self.drafts, self.draft_probs = [], None
        self.finish_reason = None

    @property
    def all_ids(self):
        return self.sample.prompt_ids + self.sample.response_ids

    @property
    def num_tokens(self):
        return len(self.sample.prompt_ids) + len(self.sample.response_ids)

    @property
    def num_generated(self):
        return len(self.sample.response_ids)

    @property
    def finished(self):
        return self.finish_reason is not None

    def uniforms(self, n):
        """n fresh uniforms from the request's stream (draft sampling)."""
        return torch.rand(n, generator=self.generator)

    def position_uniforms(self, n):
        """The uniforms of output positions num_generated .. num_generated + n - 1.

        Each is used for the first verification that reaches its position; a later step re-reads
        it only when no earlier decision depended on it (positions past a rejection), so every
        emitted token still meets a fresh uniform."""
        g = self.num_generated
        return self._position_u[g:g + n]

    def residual_uniform(self):
        """The uniform of a residual draw (after a rejection) in the step starting here: steps
        start at strictly increasing positions, so each is used at most once."""
        return self._residual_u[self.num_generated]


class Engine:
    """The embedded inference engine: continuous batching over KV-cache slots, one verify path for
    plain and speculative decoding (a plain step verifies zero drafts)."""

    def __init__(self, model, config=None, codec=None, proposer=None):
        self.config = config or EngineConfig()
        self.model = _cast_keeping_fp32_router_bias(model, self.config.device, self.config.dtype).eval()
        self.model.requires_grad_(False)
        self.cfg = model.cfg
        self.fast = FastForward(self.model, self.config.linear_backend)
        self.max_len = self.config.max_len or self.cfg.max_position_embeddings
        self.codec = codec
        self.backend = pick_attention_backend(self.config.device, self.config.attention_backend, self.config.dtype)
        ec = self.config
        self.steps = StepRunner(ec.device, graphs=not ec.enforce_eager, pad=ec.pad_to_buckets,
                                max_rows=ec.max_batch_size, compile_steps=ec.compile_steps)
        # MoE: expert dispatch and route recording follow the routing's data, so such steps run eagerly
        self.graphable = not any(w.moe is not None for w in self.fast.layers)
        self.allocate_cache()
        self.stop_ids = {self.cfg.eos_token_id} - {None}
        # MoE models: the experts every decoder MoE layer chose, per slot and position (the samples
        # carry them to the trainer, which replays or compares them)
        self.routes = (RouteTable(self.config.max_batch_size, self.max_len + 1, self.fast.num_moe_layers,
                                  self.cfg.moe.num_experts_per_tok, self.cfg.moe.n_routed_experts, self.config.device)
                       if self.fast.num_moe_layers else None)
        self.weight_version = 0
        self.steps_taken = 0  # loop iterations over all generate calls: the rollout worker's sign of life
        self.paused = False
        self.released_weights = {}  # name -> shape of the weights `release_memory` gave back
        self.last_stats = {}
        self.prefill_seconds = 0.0  # this generate's seconds in the target's prompt forwards and first tokens
        self.step_k = 0  # drafts the proposer makes this iteration (verified at the next)
        self.may_draft = True  # whether a step of this generate may draft (the k policy says at each generate)
        self.set_proposer(proposer or Proposer())

    @classmethod
    def from_checkpoint(cls, path, config=None, proposer=None):
        from rollout.tokenizer import codec_or_none  # tokenizers is only needed with text I/O

        cfg, state, _ = load_hf_checkpoint(path)
        model = CausalLMWithMTP(cfg)
        model.load_state_dict(state, strict=True)
        codec = codec_or_none(path)
        return cls(model, config, codec, proposer)

    def allocate_cache(self):
        """(Re)allocate the target's KV cache, zeroed; graphs captured on the previous one are dropped.
        One position past the context is the scratch position (rollout/embedded/kv_cache.py)."""
        room = FLASH_QUERY_ROOM if self.backend == "flash" else 0
        self.cache = make_kv_cache(self.cfg, self.cfg.num_hidden_layers, self.config.max_batch_size, self.max_len + 1,
                                   self.config.dtype, self.config.device, scratch_room=room)
        self.steps.reset()

    def set_proposer(self, proposer, k_policy=None):
        """Install a proposer and the policy choosing its k per step (default: always its max)."""
        require(self.backend != "flash" or proposer.num_speculative_tokens < FLASH_QUERY_ROOM,
                f"attention backend 'flash' verifies at most {FLASH_QUERY_ROOM} tokens a step; use at most "
                f"{FLASH_QUERY_ROOM - 1} speculative tokens or the 'sdpa' backend")
        self.steps.forget(DRAFT_FAMILY)  # the previous proposer's graphs read its caches
        self.proposer = proposer
        proposer.attach(self)
        self.graph_query_windows(1 + proposer.num_speculative_tokens)  # a verify's window
        self.k_policy = k_policy or FixedK(proposer.num_speculative_tokens)

    def graph_query_windows(self, q_len):
        """Run query windows of up to q_len tokens as graphs (where steps run as graphs); longer ones
        (prompts, catch-ups) run eagerly. A speculative engine graphs its verifies (1 + k tokens); a
        benchmark asks a plain engine for the same to time the verifies a speculative one runs."""
        self.steps.max_graph_q_len = q_len

    # ---------------------------------------------------------------- public API
    def generate(self, samples, sampling):
        """Fill response_ids / response / rollout_logprobs / finish_reason / spec of `samples`."""
        require(not self.paused, "the engine is paused (a weight update is in progress); call resume() first")
        if self.released_weights:
            raise RuntimeError("the engine's weights were released (release_memory) and no push brought them back")
        for cache in self.kv_caches():
            cache.restore()
        for s in samples:
            self._check_prompt(s)
        requests = [Request(s, sampling, self._generator(sampling, s)) for s in samples]
        for s in samples:
            s.response_ids, s.rollout_logprobs, s.weight_version = [], [], self.weight_version
            s.routed_experts = None
            s.spec.__init__()
        self.k_policy.prepare(self)
        self.k_policy.begin(self.weight_version)
        self.may_draft = self.k_policy.drafts_this_generate(len(requests))
        self.prefill_seconds = 0.0
        start = time.perf_counter()
        self._run(requests, sampling)
        elapsed = time.perf_counter() - start
        for r in requests:
            r.sample.finish_reason = r.finish_reason
            if self.codec:
                r.sample.response = self.codec.decode(r.sample.response_ids)
        generated = sum(r.num_generated for r in requests)
        self.last_stats = {"generated_tokens": generated, "seconds": elapsed, "prefill_seconds": self.prefill_seconds,
                           "tokens_per_s": generated / max(elapsed, 1e-9), **self.k_policy.summary()}
        return samples

    def named_weights(self):
        """(canonical name, tensor) of the weights the trainer syncs: the model's, and a trained
        external draft's under its wire names (the proposer's `named_draft_weights`)."""
        yield from self.model.named_parameters()
        yield from self.proposer.named_draft_weights()

    def load_weights(self, named_tensors, version):
        """Copy (canonical HF name, tensor) pairs into the model (an external draft's names into the
        proposer's draft); every name must exist."""
        params = dict(self.model.named_parameters())
        draft = self.proposer.loadable_draft_weights()
        params.update(draft)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise UserError(f"load_weights: unknown tensor {name!r}; expected canonical HF names")
                if name in self.released_weights:  # given back by release_memory: this push brings it back
                    params[name].data = torch.empty(self.released_weights.pop(name), dtype=params[name].dtype,
                                                    device=params[name].device)
                params[name].copy_(tensor.to(params[name].dtype))
                if name in draft:
                    self.proposer.draft_synced()
        if self.released_weights:
            raise RuntimeError(f"load_weights: the push did not bring back {len(self.released_weights)} released "
                               f"weights (first: {next(iter(self.released_weights))}); the engine cannot decode")
        self.fast.refresh(in_place=self.steps.graphs)  # captured graphs keep reading the fused tensors
        self.weight_version = version

    def release_memory(self, weights=False):
        """Give back the KV caches (the engine's and its proposer's; the next generate allocates them
        again) and, with `weights`, the model's weights and their packed copies (the next load_weights
        brings them back): memory by turns with a trainer on the same device."""
        self.steps.reset()  # the captured graphs read the caches (and fused weights) given back here
        for cache in self.kv_caches():
            cache.release()
        if weights:
            self.fast.release()  # its fused copies; everything else reads the parameters when it runs
            for name, p in self.model.named_parameters():
                self.released_weights[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if torch.device(self.config.device).type == "cuda":
            torch.cuda.empty_cache()  # to the device, for the trainer, not kept in torch's cache

    def kv_caches(self):
        return [self.cache, *self.proposer.kv_caches()]

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False

    def stats(self):
        return dict(self.last_stats, weight_version=self.weight_version)

    # ---------------------------------------------------------------- the loop
    def _run(self, requests, sampling):
        waiting, running = deque(requests), []
        free_slots = list(range(self.config.max_batch_size))[::-1]
        while waiting or running:
            self.steps_taken += 1
            admitted = []
            while waiting and free_slots:
                r = waiting.popleft()
                r.slot = free_slots.pop()
                admitted.append(r)
            decoding = list(running)
            running += admitted
            self.step_k = self.k_policy.choose(len(running))
            if admitted:
                self._prefill(admitted, sampling)
            if decoding:
                self._verify_step(decoding, sampling)
            finished = [r for r in running if r.finished]
            for r in finished:
                self._take_routes(r)
                running.remove(r)
                free_slots.append(r.slot)
                self.proposer.release(r)
            if finished and self.config.compact_slots:
                free_slots = self._compact_slots(running)

    def _compact_slots(self, running):
        """Move the requests in slots >= n into the holes below n (n = len(running)), order `running`
        by slot and return the free slots (lowest popped first), so every batch sits in consecutive
        slots. Why: rows in scattered slots make attention gather every live row's keys and values
        at every layer of every step, where a move copies one request's entries once (BENCHMARKS.md
        measures the two)."""
        n = len(running)
        taken = {r.slot for r in running}
        holes = [s for s in range(n) if s not in taken]
        movers = sorted((r for r in running if r.slot >= n), key=lambda r: r.slot)
        if holes:
            moves = list(zip(movers, holes))
            length = max(r.num_tokens for r, _ in moves)  # entries past a request's tokens are never read
            self.cache.move_slots([r.slot for r, _ in moves], holes, length)
            olds = [r.slot for r, _ in moves]
            if self.routes is not None:
                self.routes.copy_rows(olds, holes, length)
            for r, hole in moves:
                r.slot = hole
            self.proposer.move_slots([r for r, _ in moves], olds)
            running.sort(key=lambda r: r.slot)
        return list(range(n, self.config.max_batch_size))[::-1]

    def _prefill(self, reqs, sampling):
        """One ragged forward over the admitted prompts; a prompt shared by several requests (a
        GRPO group) is computed once and its KV entries copied into the other requests' slots. Its clock
        (`prefill_seconds`) stops before the proposer's pass over the prompts: drafting is speculation's cost."""
        start = time.perf_counter()
        leaders, source = self._prompt_leaders(reqs)
        hidden, mtp_hidden = self._prompt_forward(leaders)
        lengths = device_tensor([len(r.sample.prompt_ids) for r in leaders], self.config.device)
        last = hidden[torch.arange(len(leaders)), lengths - 1]
        logprobs = processed_logprobs(self.fast.logits(last), sampling.temperature, sampling.top_k, sampling.top_p)
        if source is not None:
            self._copy_prompt_cache(leaders, reqs, source)
            logprobs, mtp_hidden = logprobs[source], mtp_hidden[source]
        empty = torch.zeros(len(reqs), 0, dtype=torch.long, device=self.config.device)
        self._accept(reqs, logprobs.unsqueeze(1), empty, [0] * len(reqs), sampling, None)
        n_new = [len(r.sample.prompt_ids) for r in reqs]
        for r in reqs:
            r.num_cached = len(r.sample.prompt_ids)
        self.prefill_seconds += time.perf_counter() - start
        self._propose(reqs, mtp_hidden, [0] * len(reqs), n_new)

    def _prompt_leaders(self, reqs):
        """(the requests whose prompts get computed, for each request its leader's index there or
        None when every prompt is computed for itself)."""
        if not self.config.share_prompt_prefill:
            return reqs, None
        index, leaders, source = {}, [], []
        for r in reqs:
            key = tuple(r.sample.prompt_ids)
            if key not in index:
                index[key] = len(leaders)
                leaders.append(r)
            source.append(index[key])
        if len(leaders) == len(reqs):
            return reqs, None
        return leaders, device_tensor(source, self.config.device)

    def _prompt_forward(self, reqs):
        """Prefill: one eager step over the prompts (their lengths vary too much for graphs)."""
        return self._forward(reqs, [r.sample.prompt_ids for r in reqs], [0] * len(reqs), with_logits=False,
                             graphable=False)

    def _copy_prompt_cache(self, leaders, reqs, source):
        """Every layer's prompt keys/values from each leader's slot into its followers' slots."""
        width = max(len(r.sample.prompt_ids) for r in leaders)
        src = device_tensor([leaders[i].slot for i in source.tolist()], self.config.device)
        dst = device_tensor([r.slot for r in reqs], self.config.device)
        follow = src != dst
        self.cache.copy_slots(src[follow], dst[follow], width)
        if self.routes is not None:
            self.routes.copy_rows(src[follow], dst[follow], width)

    def _verify_step(self, reqs, sampling):
        start = time.perf_counter()
        generated_before = sum(r.num_generated for r in reqs)
        counts = [self._draft_budget(r) for r in reqs]
        rows = [[r.all_ids[-1]] + list(r.drafts[:c]) for r, c in zip(reqs, counts)]
        starts = [r.num_cached for r in reqs]
        _, mtp_hidden, logits = self._forward(reqs, rows, starts, with_logits=True)
        logprobs = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        drafts = pad_token_rows(rows, self.config.device)[:, 1:]
        draft_probs = self._stack_draft_probs(reqs, drafts, logprobs.shape[-1])
        n_acc = self._accept(reqs, logprobs, drafts, counts, sampling, draft_probs)
        for r, a in zip(reqs, n_acc):
            r.num_cached += 1 + a
        verified = time.perf_counter()
        drafted = self._propose(reqs, mtp_hidden, starts, [1 + a for a in n_acc])
        if self.k_policy.observes:
            self._observe_step(reqs, drafts.shape[1], counts, n_acc, drafted, start, verified, generated_before)

    def _observe_step(self, reqs, k_verified, counts, n_acc, drafted, start, verified, generated_before):
        """Tell the k policy what this step cost and what got accepted."""
        self.k_policy.observe(StepRecord(
            len(reqs), k_verified, verified - start, self.step_k if drafted else None,
            time.perf_counter() - verified, sum(r.num_generated for r in reqs) - generated_before,
            *_per_position(counts, n_acc)))

    def _accept(self, reqs, logprobs, drafts, counts, sampling, draft_probs):
        """Verify drafts, append the emitted tokens (cut at stop / budget), update stats."""
        k = drafts.shape[1]
        # synthetic acceptance draws its coin flips at any temperature
        needs_uniforms = not sampling.greedy or self.config.rejection_sample_method == "synthetic"
        uniforms = self._uniforms(reqs, counts, k).to(logprobs.device) if needs_uniforms \
            else torch.zeros(len(reqs), k + 2, device=logprobs.device)
        res = verify(logprobs, drafts, device_tensor(counts, logprobs.device), uniforms, sampling.greedy,
                     self.config.rejection_sample_method, draft_probs, self.config.synthetic_acceptance_rates)
        n_acc = res.num_accepted.tolist()
        emitted, emitted_lp = res.emitted.tolist(), res.emitted_logprobs.tolist()
        for i, r in enumerate(reqs):
            self._append(r, emitted[i][:n_acc[i] + 1], emitted_lp[i][:n_acc[i] + 1])
            # vLLM's count (rollout/spec_stats.py): a draft the verifier accepted counts even when
            # a stop token before it ends the response
            _record_spec(r.sample.spec, counts[i], n_acc[i])
        return n_acc

    def _append(self, r, tokens, logprobs):
        """Append tokens until a stop token or the budget; returns how many were appended."""
        stops = (set() if r.sampling.ignore_eos else self.stop_ids) | set(r.sampling.stop_token_ids)
        for n, (tok, lp) in enumerate(zip(tokens, logprobs), start=1):
            r.sample.response_ids.append(tok)
            r.sample.rollout_logprobs.append(lp)
            if tok in stops:
                r.finish_reason = "stop"
            elif r.num_generated >= r.sampling.max_new_tokens or r.num_tokens >= self.max_len:
                r.finish_reason = "length"
            if r.finished:
                return n
        return len(tokens)

    def _draft_budget(self, r):
        """Drafts this request may verify: never past max_new_tokens or the context."""
        remaining = r.sampling.max_new_tokens - r.num_generated
        return max(0, min(len(r.drafts), remaining - 1, self.max_len - r.num_tokens))

    @staticmethod
    def _uniforms(reqs, counts, k):
        """[B, k+2]: the uniforms of each request's own verify positions (c + 1) and its residual
        draw (stored last); they depend on neither the batch nor how many drafts a step brings."""
        out = torch.zeros(len(reqs), k + 2)
        for i, (r, c) in enumerate(zip(reqs, counts)):
            out[i, :c + 1], out[i, -1] = r.position_uniforms(c + 1), r.residual_uniform()
        return out

    def _stack_draft_probs(self, reqs, drafts, vocab):
        k = drafts.shape[1]
        if k == 0 or all(r.draft_probs is None for r in reqs):
            return None
        # a request without q drafted deterministically: its q is one-hot at its drafts
        out = torch.nn.functional.one_hot(drafts, vocab).to(torch.float32)
        for i, r in enumerate(reqs):
            if r.draft_probs is not None:
                n = min(k, r.draft_probs.shape[0])
                out[i, :n] = r.draft_probs[:n, :vocab]
        return out

    def _forward(self, reqs, rows, starts, with_logits, graphable=True):
        """One static step of the target over `rows` (each request's new tokens, host lists)
        written from `starts` (host ints): (final-normed hidden states, the hidden states the
        proposer reads: the MTP layer's input, or an EAGLE-3 draft's aux hidden states[, logits]),
        the requests' rows only."""
        layout = self.steps.layout(self.cache, [r.slot for r in reqs], starts, [len(x) for x in rows],
                                   graphable and self.graphable)
        aux = tuple(getattr(self.proposer, "aux_hidden_layers", ()))
        key = ("target", layout.shape, with_logits, aux)
        self.fast.route_writer = self._route_writer(layout)
        try:
            with torch.inference_mode():
                out = self.steps.run(key, self.target_step(layout.shape, aux, with_logits),
                                     (layout.tokens(rows), layout.slots, layout.starts), layout.graphed)
        finally:
            self.fast.route_writer = None
        return [x[:layout.n] for x in out]

    def target_step(self, shape, aux_layers, with_logits):
        """The target's step function at `shape`: (tokens [B, Q], slots [B], starts [B]) ->
        (hidden, proposer hidden[, logits]), each [B, Q, ...]; reads and writes the KV cache."""
        def step(tokens, slots, starts):
            positions = shape.positions(starts).clamp(max=self.max_len)
            view = self.cache.static_step(slots, starts, shape, self.backend)
            hidden, proposer_hidden = self.fast.states(tokens, positions, view.layers(self.cfg.num_hidden_layers),
                                                       aux_layers)
            if with_logits:
                return hidden, proposer_hidden, self.fast.logits(hidden)
            return hidden, proposer_hidden
        return step

    def _route_writer(self, layout):
        """write(layer, indices [B*Q, k]) into the route table at the forward's real (slot, position)
        pairs, padding left out; None for dense models. Last write wins: a rejected draft's
        position is rewritten by the next forward, which feeds the token kept there."""
        if self.routes is None:
            return None
        q = layout.shape.q_len
        real = [(b * q + i, slot, start + i)
                for b, (slot, start, c) in enumerate(zip(layout.slot_list, layout.start_list, layout.counts))
                for i in range(c)]
        device = layout.slots.device
        flat, rows, at = (device_tensor(x, device) for x in zip(*real))
        return lambda layer, indices: self.routes.write(layer, rows, at, indices.index_select(0, flat))

    def _take_routes(self, r):
        """A finished request's routes into its sample: every position but the last token's, each
        computed with the token the sample finally holds there."""
        if self.routes is not None:
            r.sample.routed_experts = self.routes.read(r.slot, r.num_tokens - 1).cpu()

    def _propose(self, reqs, hidden, starts, n_valid):
        """Drafts for the live requests, at most step_k each; False when none was live.
        hidden: the MTP input states of the new positions (what TargetForward.hidden carries);
        starts, n_valid: host ints per request."""
        live = [i for i, r in enumerate(reqs) if not r.finished]
        if not live:
            return False
        dev = hidden.device
        idx = device_tensor(live, dev)
        live_starts, live_valid = [starts[i] for i in live], [n_valid[i] for i in live]
        with torch.inference_mode():
            self.proposer.propose(TargetForward([reqs[i] for i in live], hidden[idx], device_tensor(live_starts, dev),
                                                device_tensor(live_valid, dev), live_starts, live_valid))
        for i in live:  # proposers that cannot draft fewer (ngram, suffix, draft model) are cut here
            r = reqs[i]
            if len(r.drafts) > self.step_k:
                r.drafts = r.drafts[:self.step_k]
                r.draft_probs = None if r.draft_probs is None else r.draft_probs[:self.step_k]
        return True

    # ---------------------------------------------------------------- cost probes (adaptive k)
    def _synchronize(self):
        if torch.device(self.config.device).type == "cuda":
            torch.cuda.synchronize(self.config.device)

    def profile_verify(self, batch_size, q_len, context=32, repeats=3, back_to_back=1, warm_up=True):
        """Seconds of one verify forward (trunk + head + log-probs) of batch_size rows x q_len
        tokens after `context` cached ones; writes only into free slots (call between generates).
        back_to_back > 1: the mean of that many forwards issued without waiting in between (on
        CUDA the device's time per step once the host keeps ahead of it). warm_up: one untimed call
        first (the first calls allocate)."""
        context = max(0, min(context, self.max_len - q_len))

        class Probe:
            """Stands in for a request in slot i."""

            def __init__(self, slot):
                self.slot = slot

        probes, rows = [Probe(i) for i in range(batch_size)], [[0] * q_len] * batch_size

        def steps():
            for _ in range(back_to_back):
                _, _, logits = self._forward(probes, rows, [context] * batch_size, with_logits=True)
                processed_logprobs(logits, 1.0, 0, 1.0)
        return _min_seconds(steps, repeats, self._synchronize, warm_up) / back_to_back

    def profile_draft(self, batch_size, k, repeats=3, new_tokens=2, warm_up=True):
        """Seconds the proposer takes to draft k tokens for batch_size rows after catching up
        `new_tokens` verified positions per row (0 if it cannot say, and at k = 0 unless the
        proposer works at every step: `costs_at_k0`)."""
        probe = getattr(self.proposer, "profile_draft", None)
        if probe is None or (k == 0 and not self.proposer.costs_at_k0):
            return 0.0
        return _min_seconds(lambda: probe(batch_size, k, new_tokens), repeats, self._synchronize, warm_up)

    # ---------------------------------------------------------------- checks and helpers
    def _check_prompt(self, s):
        require(len(s.prompt_ids) > 0, f"prompt {s.index} is empty")
        require(len(s.prompt_ids) < self.max_len,
                f"prompt {s.index} has {len(s.prompt_ids)} tokens; the context is {self.max_len} "
                "(shorten the prompt or raise the engine's max_len)")
        bad = [t for t in s.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        require(not bad, f"prompt {s.index} has token id {bad[0] if bad else ''} outside the vocabulary "
                f"[0, {self.cfg.vocab_size})")

    def _generator(self, sampling, sample):
        g = torch.Generator()
        g.manual_seed(request_seed(sampling, sample))
        return g


def _cast_keeping_fp32_router_bias(model, device, dtype):
    """`model` on device in dtype, but the weights every part keeps fp32 (vime.precision.held_dtype: the
    MoE routers' correction bias) kept so, as the trainer syncs them and vLLM holds them."""
    fp32 = {n: p.detach().float().clone() for n, p in model.named_parameters() if held_dtype(n, dtype) != dtype}
    model = model.to(device, dtype)
    for name, param in model.named_parameters():
        if name in fp32:
            param.data = fp32[name].to(device)
    return model


def _min_seconds(fn, repeats, synchronize, warm_up=True):
    if warm_up:
        fn()  # first calls allocate
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        t = time.perf_counter()
        fn()
        synchronize()  # CUDA launches return before the kernels ran
        best = min(best, time.perf_counter() - t)
    return best


def _per_position(counts, n_acc):
    """(rows that reached draft position i, rows that accepted it) for each position: the
    conditional acceptance at i is their ratio."""
    k = max(counts, default=0)
    reached = [sum(1 for c, a in zip(counts, n_acc) if c > i and a >= i) for i in range(k)]
    accepted = [sum(1 for a in n_acc if a > i) for i in range(k)]
    return reached, accepted


def _record_spec(spec, drafted, accepted):
    spec.verify_steps += 1
    spec.draft_tokens += drafted
    spec.accepted_tokens += accepted
    for i in range(drafted):
        if i >= len(spec.drafted_per_pos):
            spec.drafted_per_pos.append(0)
            spec.accepted_per_pos.append(0)
        spec.drafted_per_pos[i] += 1
        spec.accepted_per_pos[i] += int(i < accepted)

