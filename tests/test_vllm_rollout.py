"""The vLLM rollout backend (real vLLM, CPU build) against independent references.

References: transformers' Qwen2ForCausalLM on the MiMo trunk (greedy tokens, teacher-forced
log-probs), vime's own checksum of the tensors sent (fingerprints), and the embedded engine
where it serves MiMo. One vLLM instance (MTP, k = 2) serves the whole module; the plain and
k = 1 instances are in the slow run (vLLM takes 20-60 s to start on 2 busy cores).
"""
import os

import pytest
import torch

pytest.importorskip("vllm")

from vime.models.families import from_canonical, is_mtp_name, to_canonical  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.task import make_prompts  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from tests.fp32_bounds import reduction_rtol  # noqa: E402
from tests.mimo_fixtures import MIMO_SMALL, make_tiny_mimo  # noqa: E402
from tests.vllm_spec_fixtures import hf_greedy  # noqa: E402
from vime import weight_sync  # noqa: E402
from vime.cpu_cores import cores_for_slot  # noqa: E402
from vime.errors import UserError  # noqa: E402

L = MIMO_SMALL["num_hidden_layers"]
# the module's engine is a node's second (slot 1): its second core (vLLM's own choice: all but the last,
# for every engine of the node)
ENGINE_CORES = cores_for_slot(os.sched_getaffinity(0), slot=1, threads=1)


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    return make_tiny_mimo(str(tmp_path_factory.mktemp("tiny_mimo")), seed=1)


@pytest.fixture(scope="module")
def prompts(mimo_ckpt):
    codec = TextCodec(mimo_ckpt)
    rows = make_prompts(20, seed=5) + make_prompts(4, seed=6, digits=2)
    return [codec.encode_prompt(r["prompt"], 1) for r in rows]


@pytest.fixture(scope="module")
def vllm_mtp(mimo_ckpt):
    from rollout.vllm.backend import VLLMBackend

    backend = VLLMBackend(mimo_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, max_batch_size=32,
                          cpu_cores=ENGINE_CORES)
    yield backend
    backend.close()


def checkpoint_tensors(path):
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def canonical(path):
    raw = checkpoint_tensors(path)
    return to_canonical(raw, "mimo", L, 1)


def hf_trunk_model(path, state=None):
    """transformers' Qwen2ForCausalLM on the checkpoint's trunk (optionally other trunk tensors):
    a reference that shares no code with vime or vLLM."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    if state is not None:
        trunk = {k: v for k, v in state.items() if not k.startswith("model.mtp_layers.")}
        model.load_state_dict(trunk, strict=False)
    return model


def vllm_greedy(backend, prompts, max_new_tokens=24):
    samples = samples_for_prompts(prompts)
    backend.generate(samples, SamplingParams(temperature=0, max_new_tokens=max_new_tokens))
    return [s.response_ids for s in samples]


def test_vllm_greedy_with_mtp_speculation_equals_transformers(vllm_mtp, mimo_ckpt, prompts):
    ref = hf_trunk_model(mimo_ckpt)
    got = vllm_greedy(vllm_mtp, prompts)
    assert got == [hf_greedy(ref, p, 24) for p in prompts]
    assert vllm_mtp.stats()["spec"]["draft_tokens"] > 0  # speculation really ran


def logprob_tolerance(logits):
    """vLLM and transformers compute the same fp32 logits with different kernels (reduction
    order): each of the 4 reductions per layer (q/k/v, attention, o, MLP) plus norm and head
    is a sum of <= intermediate_size terms, so per Higham |error| <= depth * n * u * scale.
    A log-prob is a logit minus a logsumexp of logits: twice that, at the logits' scale."""
    depth = 4 * L + 3
    return 2 * reduction_rtol(MIMO_SMALL["intermediate_size"], depth) * max(1.0, float(logits.abs().max()))


def assert_logprobs_match(backend, ref, prompts, seed, temperature=1.0):
    samples = samples_for_prompts(prompts, n=4)
    backend.generate(samples, SamplingParams(temperature=temperature, max_new_tokens=16, seed=seed))
    for s in samples:
        tokens = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = ref(tokens).logits[0, len(s.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        diff = (expected - torch.tensor(s.rollout_logprobs)).abs().max().item()
        assert diff <= logprob_tolerance(logits / temperature), (s.index, s.sample_index, diff)
    assert len({tuple(s.response_ids) for s in samples}) > 1  # really sampled


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_sampled_token_logprobs_equal_the_trainers_definition(vllm_mtp, mimo_ckpt, prompts, temperature):
    """log_softmax(logits / T) of each token sampled under MTP speculation, teacher-forced
    through transformers (T = 0.7 was NaN before the expand-kernel repair)."""
    assert_logprobs_match(vllm_mtp, hf_trunk_model(mimo_ckpt), prompts[:8], seed=7, temperature=temperature)


def test_seeded_sampling_over_the_step_token_budget(vllm_mtp, mimo_ckpt, prompts):
    """Seeded sampled requests whose prompts together exceed vLLM's per-step token budget (4096
    on CPU) complete with the trainer's log-probs: vLLM's chunked prefill would split a prompt
    and rewind its seeded generator, which the CPU generator cannot do (the engine died)."""
    long_prompts = [(p * (200 // len(p) + 1))[:200] for p in prompts[:8]]  # 8 x 4 samples x 200 > 4096
    assert_logprobs_match(vllm_mtp, hf_trunk_model(mimo_ckpt), long_prompts, seed=11)


def test_the_engine_computes_on_the_cores_it_was_given(vllm_mtp):
    """The OS's affinity of vLLM's worker process is the engine's cores (vLLM's automatic
    binding gives every engine of a node the same cores), and the binding does not leak
    into later engines of this process."""
    from rollout.vllm.backend import BIND_ENV

    assert vllm_mtp.compute_cores() == ENGINE_CORES
    assert BIND_ENV not in os.environ


def test_nccl_transfer_rounds_name_the_checkpoint_tensors_vllm_loads(vllm_mtp, mimo_ckpt):
    """--vllm-weight-transfer nccl tells vLLM each round's names, dtypes and shapes before the
    broadcast: the target round is the checkpoint's trunk tensors, the draft round its MTP
    tensors plus the embedding and head the drafter shares (the checkpoint file is the reference)."""
    from rollout.vllm.weight_transfer import update_infos

    raw = checkpoint_tensors(mimo_ckpt)
    infos = dict(update_infos(list(canonical(mimo_ckpt).items()), vllm_mtp.weight_receiver("nccl").plan()))
    mtp = {k for k in raw if k.startswith("model.mtp_layers.")}
    shared = {k for k in raw if "embed_tokens" in k or k.startswith("lm_head")}
    assert set(infos) == {"target", "mtp"}
    assert set(infos["target"]["names"]) == set(raw) - mtp and set(infos["mtp"]["names"]) == mtp | shared
    for info in infos.values():
        assert info["shapes"] == [list(raw[k].shape) for k in info["names"]]
        assert info["dtype_names"] == [str(raw[k].dtype).removeprefix("torch.") for k in info["names"]]
    target_only = vllm_mtp.weight_receiver("nccl", keep_draft=False).plan()
    assert "mtp" not in dict(update_infos(list(canonical(mimo_ckpt).items()), target_only))


def test_speculative_counters_are_per_call_deltas(vllm_mtp, prompts):
    """Greedy is deterministic, so two identical calls must report identical counters:
    cumulative counters (vLLM's own) would double."""
    vllm_greedy(vllm_mtp, prompts[:6], 16)
    first = vllm_mtp.stats()["spec"]
    vllm_greedy(vllm_mtp, prompts[:6], 16)
    assert vllm_mtp.stats()["spec"] == first and first["draft_tokens"] > 0
    assert first["draft_tokens"] == 2 * first["drafts"]  # k = 2 tokens per drafting step


def perturbed(state, seed):
    """Every tensor moved by independent noise (an RL step moves all of them)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_reloaded_weights_are_served_and_fingerprinted_like_the_trainers(vllm_mtp, mimo_ckpt, prompts):
    """After a reload vLLM computes the log-probs transformers computes with the new weights
    (every kernel took them, the tied LM head included), and its fingerprint equals vime's
    checksum of the sent tensors (trunk and draft)."""
    original = canonical(mimo_ckpt)
    new = perturbed(original, seed=11)
    try:
        vllm_mtp.load_weights(list(new.items()), version=1)
        fp = vllm_mtp.fingerprint()
        assert fp["target"] == weight_sync.checksum([(k, v) for k, v in new.items() if not is_mtp_name(k, L)])
        assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in new.items() if is_mtp_name(k, L)])
        assert vllm_mtp.stats()["readback_fraction"] > 0
        ref = hf_trunk_model(mimo_ckpt, from_canonical(new, "mimo", L, 1))
        assert_logprobs_match(vllm_mtp, ref, prompts[:8], seed=8)
        assert vllm_greedy(vllm_mtp, prompts[:8], 16) == [hf_greedy(ref, p, 16) for p in prompts[:8]]
        assert vllm_mtp.digests() == weight_sync.digests(new.items())
    finally:
        vllm_mtp.load_weights(list(original.items()), version=0)


def test_a_target_only_reload_leaves_the_draft_fingerprint_stale(vllm_mtp, mimo_ckpt):
    original = canonical(mimo_ckpt)
    new = perturbed(original, seed=12)
    try:
        vllm_mtp.load_weights([(k, v) for k, v in new.items() if not is_mtp_name(k, L)], version=1)
        fp = vllm_mtp.fingerprint()
        assert fp["target"] == weight_sync.checksum([(k, v) for k, v in new.items() if not is_mtp_name(k, L)])
        assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in original.items() if is_mtp_name(k, L)])
        assert fp["draft"] != weight_sync.checksum([(k, v) for k, v in new.items() if is_mtp_name(k, L)])
    finally:
        vllm_mtp.load_weights(list(original.items()), version=0)


@pytest.mark.parametrize("spec, needle", [
    ({"method": "magic", "num_speculative_tokens": 2}, "method: Input should be"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "without speculative model"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "greater than 0"),
    ({"method": "mtp", "num_speculative_token": 2}, "did you mean 'num_speculative_tokens'"),
])
def test_vllm_refuses_bad_speculative_configs_in_one_line(mimo_ckpt, spec, needle):
    from rollout.vllm.backend import check_speculative_config

    with pytest.raises(UserError) as e:
        check_speculative_config(mimo_ckpt, spec)
    assert needle in str(e.value) and "\n" not in str(e.value) and "--vllm-speculative-config" in str(e.value)


def test_vllm_accepts_its_own_keys_the_embedded_engine_lacks(mimo_ckpt):
    from rollout.vllm.backend import check_speculative_config

    check_speculative_config(mimo_ckpt, {"method": "mtp", "num_speculative_tokens": 2, "parallel_drafting": True})
    check_speculative_config(mimo_ckpt, '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1])
def test_vllm_greedy_plain_and_mtp_k1_equal_transformers(mimo_ckpt, prompts, k):
    from rollout.vllm.backend import VLLMBackend

    backend = VLLMBackend(mimo_ckpt, {"method": "mtp", "num_speculative_tokens": k} if k else None, 32)
    try:
        ref = hf_trunk_model(mimo_ckpt)
        assert vllm_greedy(backend, prompts) == [hf_greedy(ref, p, 24) for p in prompts]
    finally:
        backend.close()


def test_vllm_greedy_and_acceptance_equal_the_embedded_engines(vllm_mtp, mimo_ckpt, prompts):
    """Same checkpoint, same drafter math (pre-norm hidden state, zeroed embedding at position 0):
    the tokens agree, and so do the accepted drafts of each request, except that vLLM also counts
    drafts accepted past the request's end (max tokens / EOS) which the embedded engine never
    verifies: at most k = 2 per request, at its last step."""
    from rollout.embedded.engine_builder import build_engine

    engine = build_engine(mimo_ckpt, {"method": "mtp", "num_speculative_tokens": 2})
    samples = samples_for_prompts(prompts)
    engine.generate(samples, SamplingParams(temperature=0, max_new_tokens=24))
    assert vllm_greedy(vllm_mtp, prompts) == [s.response_ids for s in samples]
    extra = []
    for p, s in zip(prompts[:12], samples):
        vllm_greedy(vllm_mtp, [p])
        extra.append(vllm_mtp.stats()["spec"]["accepted_tokens"] - s.spec.accepted_tokens)
    assert all(0 <= e <= 2 for e in extra), extra
    assert sum(s.spec.accepted_tokens for s in samples[:12]) > 0  # drafts were accepted at all


def test_identical_greedy_work_gives_identical_speculation_metrics(vllm_mtp, mimo_ckpt, prompts):
    """One definition per metric on both backends (vLLM's): the same greedy requests give the
    same whole rollout/spec_* dict. The requests are those that end at EOS well inside the
    budget: near max_new_tokens the embedded engine drafts only what it may still emit, while
    vLLM drafts k past the end, which is different work, not a different definition."""
    from rollout.backend import build_backend
    from rollout.spec_stats import spec_rates

    embedded = build_backend("embedded", mimo_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, 32)
    budget = 48
    probe = samples_for_prompts(prompts)
    embedded.generate(probe, SamplingParams(temperature=0, max_new_tokens=budget))
    ending = [p for p, s in zip(prompts, probe) if s.finish_reason == "stop" and len(s.response_ids) < budget - 2]
    assert len(ending) >= 8, "the fixture model should end most answers with EOS"
    ours = samples_for_prompts(ending)
    embedded.generate(ours, SamplingParams(temperature=0, max_new_tokens=budget))
    theirs = vllm_greedy(vllm_mtp, ending, budget)
    assert theirs == [s.response_ids for s in ours]
    want = spec_rates(vllm_mtp.stats()["spec"])
    assert want["spec_accepted_tokens"] > 0 and "spec_accept_rate_pos_1" in want
    assert spec_rates(embedded.stats()["spec"]) == want


def test_weights_handed_over_in_place_reach_vllm_as_the_file_reload_brings_them(vllm_mtp, mimo_ckpt, prompts):
    """An engine on the trainer's device maps the trainer's buckets and shares each round on into vLLM's
    worker (shared memory here, CUDA IPC on a GPU); vLLM then serves and fingerprints what the reload
    path (a file in shared memory, the reference) makes it serve."""
    from trainer.weight_senders import IN_PLACE, SENDERS

    original = canonical(mimo_ckpt)
    new = list(perturbed(original, seed=13).items())
    try:
        sender = SENDERS[IN_PLACE]({}, None, 1 << 14)
        header = sender.header(new)
        vllm_mtp.weight_receiver(IN_PLACE).receive(header, 1, sender.send(new)[1])
        sender.release()
        handed_over = (vllm_mtp.fingerprint(), vllm_mtp.digests(), vllm_greedy(vllm_mtp, prompts[:6], 12))
        vllm_mtp.load_weights(original.items(), version=0)
        vllm_mtp.load_weights(new, version=1)
        assert handed_over == (vllm_mtp.fingerprint(), vllm_mtp.digests(), vllm_greedy(vllm_mtp, prompts[:6], 12))
        assert handed_over[1] == weight_sync.digests(new)
    finally:
        vllm_mtp.load_weights(list(original.items()), version=0)
