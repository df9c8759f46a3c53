"""One GPU shared by a trainer rank and a rollout engine (skipped without CUDA).

- The in-place hand-over through CUDA IPC handles delivers what the bucket broadcast delivers (the same
  exchange as tests/test_weight_handover.py, with the trainer's buckets on the GPU: the engine process
  maps them where they are).
- Memory by turns on the device: the embedded engine's released KV cache and weights leave the GPU and
  come back (greedy output unchanged), the trainer's offloaded optimizer state leaves it (updates
  unchanged), each measured with torch.cuda.memory_allocated.
- vLLM's level-2 sleep, then a push: target and drafter hold the pushed weights (read back from vLLM's
  own parameters), so no drafter weights are lost (needs a CUDA build of vLLM).
- The README's main command on one GPU: rank and engine packed onto it, weights handed over in place
  and checked tensor by tensor, memory per phase logged.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_gpu_share.py` (scripts/gpu_check.sh does)."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_cuda_ipc_hand_over_delivers_what_the_bucket_broadcast_delivers():
    from tests.test_weight_handover import both_ways, update
    from vime import weight_sync

    named = update()
    got, _, _, seen_after = both_ways(named, device="cuda")
    assert got["devices"] == ["cuda"]  # mapped on the GPU, never through the host
    assert weight_sync.digests(got["in_place"].items()) == weight_sync.digests(got["bucket"].items()) \
        == weight_sync.digests(named)
    assert all(bool((v == 7).all()) for v in seen_after.values())


def test_the_engine_gives_its_kv_cache_and_weights_back_to_the_gpu_and_decodes_as_before(small_ckpt,
                                                                                        task_prompt_ids):
    from rollout.embedded.engine import EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from vime.models.hf_format import load_hf_checkpoint
    from vime.sample import samples_for_prompts

    params = SamplingParams(temperature=0, max_new_tokens=24)
    config = EngineConfig(device="cuda", attention_backend="sdpa", max_batch_size=64)
    engine = build_engine(small_ckpt, SPEC, config)
    before = [s.response_ids for s in engine.generate(samples_for_prompts(task_prompt_ids), params)]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    caches = sum(t.numel() * t.element_size() for c in engine.kv_caches() for t in c.tensors)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    engine.release_memory(weights=True)
    assert held - torch.cuda.memory_allocated() >= caches + weights
    _, state, _ = load_hf_checkpoint(small_ckpt)
    engine.load_weights(state.items(), version=1)
    assert [s.response_ids for s in engine.generate(samples_for_prompts(task_prompt_ids), params)] == before


def test_the_trainer_offloads_its_optimizer_state_off_the_gpu_and_updates_as_without(tmp_path):
    from tests.trainer_fixtures import make_tiny, random_scored_samples
    from trainer.batch import build_batch
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer

    make_tiny(tmp_path, seed=6)
    results = {}
    for offload in (False, True):
        trainer = Trainer(TrainerConfig(lr=1e-2, micro_batch_size=4), str(tmp_path))
        for seed in (1, 2):
            trainer.onload()
            trainer.train_step(build_batch(random_scored_samples(n=4, seed=seed)))
            if offload:
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                state = sum(v.numel() * v.element_size() for s in trainer.optimizer.state.values()
                            for v in s.values() if torch.is_tensor(v) and v.is_cuda)
                trainer.offload()
                assert held - torch.cuda.memory_allocated() >= state > 0
                assert all(not v.is_cuda for s in trainer.optimizer.state.values() for v in s.values())
        results[offload] = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    assert all(torch.equal(v, results[False][k]) for k, v in results[True].items())


def test_after_vllms_level_2_sleep_a_push_brings_back_target_and_drafter():
    from tests.gpu.test_vllm_gpu import cuda_vllm

    if not cuda_vllm():
        pytest.skip("needs a CUDA build of vLLM (.[vllm])")
    from safetensors.torch import load_file

    from rollout.vllm.backend import VLLMBackend
    from tests.mimo_fixtures import make_tiny_mimo
    from vime import weight_sync
    from vime.models.families import is_mtp_name, to_canonical

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_mimo(tmp, seed=1)
        backend = VLLMBackend(ckpt, SPEC, max_batch_size=16, device="cuda",
                              sharing={"gpu_share": 0.5, "release_memory": True})
        try:
            layers = 2
            state = to_canonical(load_file(f"{ckpt}/model.safetensors"), "mimo", layers, 1)
            new = {k: v * 1.01 for k, v in state.items()}
            backend.release_memory(weights=True)
            backend.pause()
            backend.load_weights(list(new.items()), version=1)
            backend.resume()
            fp = backend.fingerprint()
            assert backend.stats()["readback_fraction"] == 1.0  # every tensor read back from vLLM itself
            assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in new.items() if is_mtp_name(k, layers)])
            assert fp["target"] == weight_sync.checksum([(k, v) for k, v in new.items() if not is_mtp_name(k, layers)])
        finally:
            backend.close()


def test_the_main_command_runs_on_one_gpu_shared_by_rank_and_engine(tmp_path):
    env = dict(os.environ, RAY_ADDRESS="local", CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    cmd = [sys.executable, "train_rl.py", "--enable-mtp-training", "--mtp-num-layers", "1", "--num-rollout", "3",
           "--output-dir", str(tmp_path), "--progress", "false", "--no-use-wandb", "--check-weight-update-equal"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3 and all(r["weight_sync/in_place_engines"] == 1 for r in rows)
    assert all(r["memory/rollout_peak_gib"] > 0 and r["memory/train_peak_gib"] > 0 for r in rows)
