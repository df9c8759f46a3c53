"""The vLLM rollout backend on CUDA (`pip install -e ".[vllm]"`): the same worker code as on CPU.

Skipped without CUDA or without a CUDA build of vLLM. Run on a GPU machine with
`python -m pytest tests/gpu/test_vllm_gpu.py`.
"""
import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_vllm():
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cuda()


pytestmark = [cuda, pytest.mark.skipif(not cuda_vllm(), reason="needs a CUDA build of vLLM (.[vllm])")]


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    from tests.mimo_fixtures import make_tiny_mimo

    return make_tiny_mimo(str(tmp_path_factory.mktemp("gpu_mimo")), seed=1)


def test_vllm_on_cuda_speculates_exactly_and_takes_synced_weights(mimo_ckpt):
    from vime.models.families import is_mtp_name, to_canonical
    from vime.sample import samples_for_prompts
    from rollout.sampling_params import SamplingParams
    from rollout.vllm.backend import VLLMBackend
    from safetensors.torch import load_file
    from vime import weight_sync

    prompts = [[1, 5 + i, 7, 9] for i in range(16)]
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    outs = {}
    for name, spec in (("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 2})):
        backend = VLLMBackend(mimo_ckpt, spec, max_batch_size=16, device="cuda")
        try:
            samples = samples_for_prompts(prompts)
            backend.generate(samples, greedy)
            outs[name] = [s.response_ids for s in samples]
            if spec:
                L = 2
                state = to_canonical(load_file(f"{mimo_ckpt}/model.safetensors"), "mimo", L, 1)
                new = {k: v * 1.01 for k, v in state.items()}
                backend.load_weights(list(new.items()), version=1)
                fp = backend.fingerprint()
                assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in new.items() if is_mtp_name(k, L)])
                assert fp["target"] == weight_sync.checksum([(k, v) for k, v in new.items() if not is_mtp_name(k, L)])
        finally:
            backend.close()
    assert outs["mtp"] == outs["plain"]


def test_vllm_on_cuda_in_bf16_takes_bf16_weights_and_its_guard_sums_them(mimo_ckpt):
    """--bf16 on a GPU: vLLM in bf16 (its default there), bf16 tensors reloaded in place, and the
    fingerprint equal to the sums of the bf16 values sent (the sync guard's comparison)."""
    from safetensors.torch import load_file

    from rollout.sampling_params import SamplingParams
    from rollout.vllm.backend import VLLMBackend
    from vime import weight_sync
    from vime.models.families import is_mtp_name, to_canonical
    from vime.sample import samples_for_prompts

    prompts = [[1, 5 + i, 7, 9] for i in range(16)]
    backend = VLLMBackend(mimo_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, max_batch_size=16,
                          device="cuda", dtype=torch.bfloat16)
    try:
        samples = backend.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=24))
        assert all(len(s.response_ids) > 0 for s in samples)
        L = 2
        state = to_canonical(load_file(f"{mimo_ckpt}/model.safetensors"), "mimo", L, 1)
        new = {k: (v * 1.01).to(torch.bfloat16) for k, v in state.items()}
        backend.load_weights(list(new.items()), version=1)
        fp = backend.fingerprint()
        assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in new.items() if is_mtp_name(k, L)])
        assert fp["target"] == weight_sync.checksum([(k, v) for k, v in new.items() if not is_mtp_name(k, L)])
        assert backend.digests() == weight_sync.digests(list(new.items()))
    finally:
        backend.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the trainer's end and vLLM each need a GPU (one NCCL rank each)")
def test_nccl_weight_transfer_loads_target_and_draft_into_vllm(mimo_ckpt):
    """--vllm-weight-transfer nccl: this process, on GPU 1, plays trainer rank 0 and broadcasts new
    weights through vLLM's weight transfer engine into vLLM on GPU 0 (target, then the drafter via
    start_draft_weight_update); what vLLM's parameters hold afterwards is read back from vLLM and
    equals what was sent, tensor for tensor."""
    import threading

    from safetensors.torch import load_file

    from rollout.vllm.backend import VLLMBackend
    from rollout.vllm.weight_transfer import NcclSendingEnd, update_infos
    from vime import weight_sync
    from vime.models.families import is_mtp_name, to_canonical
    from vime.net import free_port

    L = 2
    backend = VLLMBackend(mimo_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, max_batch_size=16,
                          device="cuda", weight_transfer="nccl")
    try:
        receiver = backend.weight_receiver("nccl")
        plan, port = receiver.plan(), free_port()
        assert plan["sending_end"] is NcclSendingEnd
        rendezvous = {"master_addr": "127.0.0.1", "master_port": port, "world_size": 2, "device": "cuda"}
        new = {k: v * 1.01 for k, v in to_canonical(load_file(f"{mimo_ckpt}/model.safetensors"), "mimo", L, 1).items()}
        infos = update_infos(list(new.items()), plan)
        assert [kind for kind, _ in infos] == ["target", "mtp"]
        errors = []

        def trainer_rank0():
            try:
                torch.cuda.set_device(1)
                sender = NcclSendingEnd(plan, rendezvous)
                sender.send([(k, v.cuda()) for k, v in new.items()])  # the trainer's tensors live on its GPU
                sender.close()
            except Exception as e:  # surfaced by the assertion below
                errors.append(e)

        thread = threading.Thread(target=trainer_rank0)
        thread.start()
        receiver.join(rendezvous, 1)
        receiver.receive(infos, version=1)
        thread.join(timeout=300)
        assert not errors and not thread.is_alive(), errors
        fp = backend.fingerprint()
        assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in new.items() if is_mtp_name(k, L)])
        assert fp["target"] == weight_sync.checksum([(k, v) for k, v in new.items() if not is_mtp_name(k, L)])
        assert backend.stats()["readback_fraction"] == 1.0  # every tensor read from vLLM, none assumed
    finally:
        backend.close()


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="two trainer GPUs and one for vLLM")
def test_ep2_trainer_pushes_every_expert_through_vllms_nccl_engine_like_one_rank(tmp_path):
    """--vllm-weight-transfer nccl from an expert-parallel trainer: the experts gathered on the GPUs and
    broadcast into vLLM, checked tensor by tensor; the step and the pushed checksums equal one rank's."""
    from tests.test_train_rl_moe_layouts import SHIPPED, assert_ep2_steps_like_one_rank

    assert_ep2_steps_like_one_rank(SHIPPED["glm4_moe"], tmp_path, "vllm", "--vllm-weight-transfer", "nccl")


@pytest.mark.parametrize("adaptive", [False, True])
def test_plain_vllm_on_cuda_serves_the_dspark_draft_greedy_as_plain(adaptive):
    """The shipped DSpark draft (vLLM's Qwen3DSparkModel format) served by plain `vllm.LLM` on a GPU
    build, which drafts DSpark in its GPU model runner: greedy output equals plain decoding's, drafts
    are accepted, and with enable_adaptive_verification the key reaches vLLM and the output is the same."""
    from vllm import LLM, SamplingParams as VSampling

    from dflash_fixtures import TARGET
    from dspark_fixtures import DRAFT

    prompts = [{"prompt_token_ids": [1, 5 + i, 7, 9]} for i in range(16)]
    params = VSampling(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "dspark", "model": DRAFT, "num_speculative_tokens": 3, "enable_adaptive_verification": adaptive}
    outs = {}
    for name, config in (("plain", None), ("dspark", spec)):
        llm = LLM(model=TARGET, skip_tokenizer_init=True, dtype="float32", speculative_config=config,
                  disable_log_stats=False, gpu_memory_utilization=0.3)
        try:
            outs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            if config is not None:
                accepted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")
                assert accepted > 0
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert outs["dspark"] == outs["plain"]
