"""GLM-4.5 (MoE) and DeepSeek-V3 (MoE + MLA) served by vLLM (CPU build) against transformers.

The checkpoints are unseen random ones written by transformers' own classes with an MTP layer in
the public layout (tests/moe_fixtures.py); DeepSeek-V3's at the MLA latent vLLM's CPU kernel is
built for (512 + 64), with its YaRN rope and with plain RoPE (which is what sends the rope query
through vllm-cpu's rotary kernel). transformers is the reference for greedy tokens and log-probs; vime's checksums and
digests of the sent tensors are the reference for what vLLM holds after a weight push. The
negative control puts vLLM's own rotary dispatch back and shows the output then leaves the
model's. One engine per case serves the module (vLLM takes 20-60 s to start on 2 busy cores).
"""
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("vllm")

from rollout.sampling_params import SamplingParams  # noqa: E402
from tests.fp32_bounds import model_logprob_bound  # noqa: E402
from tests.moe_fixtures import VLLM_CPU_MLA, transformers_trunk, write_checkpoint  # noqa: E402
from vime import weight_sync  # noqa: E402
from vime.cpu_cores import cores_for_slot  # noqa: E402
from vime.models.families import from_canonical, is_mtp_name, to_canonical  # noqa: E402
from vime.models.hf_format import read_config  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402

MTP = {"method": "mtp", "num_speculative_tokens": 1}
ENGINE_CORES = cores_for_slot(os.sched_getaffinity(0), slot=1, threads=1)
# plain RoPE (DeepSeek-V3's own YaRN rotary runs torch code on CPU and never meets the kernel)
DEEPSEEK_ON_CPU_KERNEL = dict(VLLM_CPU_MLA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
CASES = {
    "deepseek_v3-mtp": ("deepseek_v3", DEEPSEEK_ON_CPU_KERNEL, MTP),
    "deepseek_v3-yarn-mtp": ("deepseek_v3", VLLM_CPU_MLA, MTP),  # DeepSeek-V3's own rope (the fixture's YaRN)
    "glm4_moe-mtp": ("glm4_moe", {}, MTP),
    "glm4_moe-plain": ("glm4_moe", {}, None),
}


def checkpoint(tmp_path_factory, family, options, seed=21):
    path = str(tmp_path_factory.mktemp(f"vllm_{family}"))
    write_checkpoint(path, family, seed=seed, **options)
    return path


# the default run serves DeepSeek-V3 with MTP on the CPU kernel's rope (MLA and fused experts; GLM-4.5 meets
# vLLM in test_vllm_routing_replay.py); the other cases: -m slow
SLOW_CASES = {"deepseek_v3-yarn-mtp", "glm4_moe-mtp", "glm4_moe-plain"}


@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                        for c in sorted(CASES)])
def served(request, tmp_path_factory):
    """(checkpoint, its vLLM backend) of each case."""
    from rollout.vllm.backend import VLLMBackend

    family, options, spec = CASES[request.param]
    path = checkpoint(tmp_path_factory, family, options)
    backend = VLLMBackend(path, spec, max_batch_size=8, cpu_cores=ENGINE_CORES)
    yield path, backend
    backend.close()


def random_prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 32) for _ in range(rng.randrange(3, 14))] for _ in range(n)]


def vllm_greedy(backend, prompts, n_new=16):
    samples = samples_for_prompts(prompts)
    backend.generate(samples, SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True))
    return [s.response_ids for s in samples]


def hf_greedy(model, prompts, n_new=16):
    return [model.generate(torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0, len(p):].tolist() for p in prompts]


def test_vllm_greedy_equals_transformers_batched_and_one_at_a_time(served):
    path, backend = served
    prompts = random_prompts()
    expected = hf_greedy(transformers_trunk(path), prompts)
    assert len({tok for row in expected for tok in row}) > 4  # outputs vary: the comparison means something
    assert vllm_greedy(backend, prompts) == expected
    assert [vllm_greedy(backend, [p])[0] for p in prompts] == expected
    if backend.spec is not None:
        assert backend.stats()["spec"]["draft_tokens"] > 0  # the MTP layer drafted


def kernel_rope(worker):
    """Put vLLM's own CPU rotary dispatch back on MLA's rotary modules (the negative control)."""
    from rollout.vllm.worker import mla_rotary_modules

    for rope in mla_rotary_modules(worker):
        rope._forward_method = rope.forward_cpu


def test_without_the_contiguous_rope_query_vllm_cpu_leaves_deepseek_v3(served):
    """The negative control of the DeepSeek-V3 case: with vLLM's CPU rotary kernel fed MLA's strided
    query, greedy output leaves transformers' and depends on the batch; rerouted again, it is right."""
    from rollout.vllm import worker as vllm_worker

    path, backend = served
    cfg = read_config(path)
    if cfg.mla is None or cfg.rope_yarn is not None:
        pytest.skip("only MLA with plain RoPE meets the kernel (GQA passes a 2-D query; YaRN runs torch code)")
    prompts = random_prompts()
    expected = hf_greedy(transformers_trunk(path), prompts)
    backend.llm.collective_rpc(kernel_rope)
    try:
        batched = vllm_greedy(backend, prompts)
        alone = [vllm_greedy(backend, [p])[0] for p in prompts]
    finally:
        assert backend.llm.collective_rpc(vllm_worker.contiguous_mla_rope)[0] == 1  # one module, shared by layers
    assert sum(a != b for a, b in zip(batched, expected)) >= len(prompts) // 2
    assert batched != alone
    assert vllm_greedy(backend, prompts) == expected


def perturbed(state, seed):
    """Every tensor moved by independent noise (an RL step moves all of them), the experts included."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def with_weights(path, tmp_path, canonical, num_layers):
    """A copy of the checkpoint holding `canonical` tensors (the MTP layer's head/embedding copies kept)."""
    out = tmp_path / "pushed"
    out.mkdir()
    for f in os.listdir(path):
        if f != "model.safetensors":
            (out / f).write_bytes(open(os.path.join(path, f), "rb").read())
    state = load_file(os.path.join(path, "model.safetensors"))
    state.update(from_canonical(canonical, read_config(path).family, num_layers, 1))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def drafter_head(worker):
    """The output head the MTP drafter drafts with (`shared_head.head`), as vLLM holds it."""
    from rollout.vllm.worker import _model

    return {n: p.detach().float().tolist() for n, p in _model(worker, True).named_parameters()
            if n.endswith("shared_head.head.weight")}


def test_pushed_weights_fill_fused_experts_and_mla_and_the_guard_reads_them_back(served, tmp_path):
    """A push of every tensor (trunk, experts, MTP layer) reloads vLLM in place: its greedy tokens and
    log-probs are transformers' with the new weights, the fused expert parameters of the target and
    of the MTP layer read back bit for bit, and the fingerprint equals the checksum of what was sent."""
    path, backend = served
    cfg = read_config(path)
    num_layers = cfg.num_hidden_layers
    original = to_canonical(load_file(os.path.join(path, "model.safetensors")), cfg.family, num_layers, 1)
    new = perturbed(original, seed=31)
    prompts = random_prompts(seed=3)
    try:
        backend.load_weights(list(new.items()), version=1)
        ref = transformers_trunk(with_weights(path, tmp_path, new, num_layers))
        assert vllm_greedy(backend, prompts) == hf_greedy(ref, prompts)
        assert_logprobs_match(backend, ref, cfg, prompts)
        experts = {k for k in new if ".mlp.experts." in k and (backend.spec or not is_mtp_name(k, num_layers))}
        assert experts <= set(backend.weights.readback_stats)  # read from vLLM's w13/w2, not the loader
        held = backend.digests()
        assert {k: held[k] for k in experts} == weight_sync.digests((k, new[k]) for k in experts)
        fp = backend.fingerprint()
        assert fp["target"] == weight_sync.checksum([(k, v) for k, v in new.items() if not is_mtp_name(k, num_layers)])
        assert fp["target"] != weight_sync.checksum([(k, v) for k, v in original.items()
                                                     if not is_mtp_name(k, num_layers)])
        if backend.spec is not None:
            assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in new.items() if is_mtp_name(k, num_layers)])
            heads = backend.llm.collective_rpc(drafter_head)[0]  # vLLM's MTP drafter drafts with the target's head
            vocab = new["lm_head.weight"].shape[0]  # vLLM pads the vocabulary
            assert heads and all(torch.equal(torch.tensor(h)[:vocab], new["lm_head.weight"]) for h in heads.values())
    finally:
        backend.load_weights(list(original.items()), version=0)


def assert_logprobs_match(backend, ref, cfg, prompts, temperature=1.0):
    samples = samples_for_prompts(prompts, n=2)
    backend.generate(samples, SamplingParams(temperature=temperature, max_new_tokens=12, seed=5))
    for s in samples:
        with torch.no_grad():
            logits = ref(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        bound = model_logprob_bound(cfg, len(s.tokens), logits.abs().max().item())
        assert (torch.tensor(s.rollout_logprobs) - expected).abs().max().item() <= bound


# ---------------------------------------------------------------- bad input, before vLLM starts
@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    """DeepSeek-V3 checkpoints with the task's prompts: the tiny latent (16 + 8), vLLM-CPU's (512 + 64),
    and one whose config.json leaves the router's keys out."""
    from rollout.task import make_prompts, write_jsonl

    out = {}
    for name, options in (("tiny_latent", {}), ("cpu_latent", VLLM_CPU_MLA), ("no_router_keys", VLLM_CPU_MLA)):
        path = checkpoint(tmp_path_factory, "deepseek_v3", options, seed=5)
        write_jsonl(make_prompts(8, seed=1), os.path.join(path, "train.jsonl"))
        out[name] = path
    config = os.path.join(out["no_router_keys"], "config.json")
    raw = json.load(open(config))
    del raw["topk_method"], raw["scoring_func"]
    json.dump(raw, open(config, "w"))
    return out


def test_mla_latent_vllm_cpu_cannot_run_is_refused_in_one_line_before_vllm_builds_its_engine_config(
        deepseek_dirs, tmp_path):
    from tests.test_bad_inputs import args_for, refused

    path = deepseek_dirs["tiny_latent"]
    refused(args_for(path, tmp_path, "--rollout-backend", "vllm"), f"--hf-checkpoint {path}",
            "kv_lora_rank 16 + qk_rope_head_dim 8", "512 + qk_rope_head_dim 64", "--rollout-backend embedded")
    # a key vLLM's own validation (its engine config, tens of seconds on CPU) would refuse: the MLA line
    # comes first, so that validation has not run
    spec = '{"method": "mtp", "num_speculative_tokens": 2, "not_a_vllm_key": 1}'
    refused(args_for(path, tmp_path, "--rollout-backend", "vllm", "--vllm-speculative-config", spec),
            "kv_lora_rank 16 + qk_rope_head_dim 8")


def test_deepseek_v3_without_its_router_keys_is_refused_for_vllm(deepseek_dirs, tmp_path):
    from tests.test_bad_inputs import args_for, refused

    path = deepseek_dirs["no_router_keys"]
    refused(args_for(path, tmp_path, "--rollout-backend", "vllm"), "config.json: topk_method is None", "'noaux_tc'")


def test_the_cpu_latent_passes_and_is_the_one_vllm_cpu_declares(deepseek_dirs):
    """The negative control of the two refusals, and CPU_MLA_LATENT tied to vLLM's CPU MLA backend."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    from rollout.vllm.backend import CPU_MLA_LATENT, check_model_on_vllm

    path = deepseek_dirs["cpu_latent"]
    check_model_on_vllm(path, read_config(path))
    assert CPUMLABackend.get_supported_head_sizes() == [sum(CPU_MLA_LATENT)]
