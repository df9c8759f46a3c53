"""Memory by turns between a rollout engine and a trainer rank on one device.

- The embedded engine gives back its KV caches (its own and its proposer's) and, asked to, its weights;
  greedy output afterwards equals a fresh engine's (its reference), and released weights come back
  only through a push (a push that misses one is refused, as is decoding before any push).
- The trainer frees its gradients and keeps its optimizer state (--offload-train: its weights too) on the host
  between steps; its updates equal a trainer's that never offloads (on CPU the device is the host: the
  storages are copied and freed all the same, and the GPU test, tests/gpu/test_gpu_share.py, checks the memory).
- The flags refused in one line where turns cannot be taken, and the vLLM backend's on vLLM's CPU build,
  which has no sleep mode."""
import pytest
import torch

from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from rollout.task import make_prompts
from rollout.tiny_model import make_random_checkpoint
from rollout.tokenizer import TextCodec
from tests.bad_input_helpers import refused
from tests.conftest import SMALL
from tests.test_bad_inputs import args_for, ckpt  # noqa: F401  (ckpt: the bad-input tests' fixture)
from trainer_fixtures import make_tiny, random_scored_samples
from vime.models.hf_format import load_hf_checkpoint
from vime.sample import samples_for_prompts

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


@pytest.fixture(scope="module", params=["mimo", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def engine_ckpt(request, tmp_path_factory):
    """A peaked random model per cache kind: per-head K/V (MiMo) and the MLA latent cache (DeepSeek-V3)."""
    path = str(tmp_path_factory.mktemp(f"turns_{request.param}"))
    make_random_checkpoint(path, seed=4, std=0.3, family=request.param, **SMALL)
    return path


def prompt_ids(path, n=12):
    codec = TextCodec(path)
    return [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(n, seed=3)]


def greedy(engine, prompts):
    return [s.response_ids for s in engine.generate(samples_for_prompts(prompts), GREEDY)]


def test_releasing_and_reallocating_the_kv_cache_leaves_greedy_output_unchanged(engine_ckpt):
    prompts = prompt_ids(engine_ckpt)
    reference = greedy(build_engine(engine_ckpt, SPEC, EngineConfig(max_batch_size=16)), prompts)
    engine = build_engine(engine_ckpt, SPEC, EngineConfig(max_batch_size=16))
    greedy(engine, prompts[:5])  # the caches hold entries of other requests when they go
    engine.release_memory()
    assert len(engine.kv_caches()) == 2 and all(t.numel() == 0 for c in engine.kv_caches() for t in c.tensors)
    assert greedy(engine, prompts) == reference
    engine.release_memory()
    assert greedy(engine, prompts) == reference


def test_released_weights_come_back_with_the_next_push_and_only_with_it(engine_ckpt):
    if "deepseek" in engine_ckpt:
        pytest.skip("weights are released alike for every family; the MiMo model covers it")
    prompts = prompt_ids(engine_ckpt)
    reference = greedy(build_engine(engine_ckpt, SPEC, EngineConfig(max_batch_size=16)), prompts)
    _, state, _ = load_hf_checkpoint(engine_ckpt)
    engine = build_engine(engine_ckpt, SPEC, EngineConfig(max_batch_size=16))
    engine.release_memory(weights=True)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="released"):
        greedy(engine, prompts)
    with pytest.raises(RuntimeError, match="did not bring back 1 released"):
        engine.load_weights([(k, v) for k, v in state.items() if k != "lm_head.weight"], version=1)
    engine.load_weights(state.items(), version=1)
    assert greedy(engine, prompts) == reference


def trainer_updates(hf_dir, offload, weights=False, **settings):
    """The trainer's weights before and after two steps, offloading between them (`offload`; `weights`:
    --offload-train) with `settings` (TrainerConfig fields)."""
    from trainer.config import TrainerConfig
    from trainer.offload import inner_optimizers
    from trainer.trainer import Trainer

    trainer = Trainer(TrainerConfig(lr=1e-2, micro_batch_size=4, **settings), hf_dir)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    for seed in (1, 2):
        trainer.onload()
        trainer.train_step(_batch(seed))
        if offload:
            trainer.offload(weights)
            # what left the device is freed there: gradient buffers, the optimizers' state, with --offload-train
            # every weight (on CPU the copies went to other host memory)
            state = [t for inner in inner_optimizers(trainer.optimizer) for s in inner.state.values()
                     for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
            freed = [*(p.main_grad for p in trainer.policy.parameters()), *state]
            freed += list(trainer.model.parameters()) if weights else []
            assert state and all(t.untyped_storage().nbytes() == 0 for t in freed)
            kept = [] if weights else list(trainer.model.parameters())
            assert all(t.untyped_storage().nbytes() > 0 for t in kept)  # the weights the engines receive
    trainer.onload()
    return before, {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}


def _batch(seed):
    from trainer.batch import build_batch

    return build_batch(random_scored_samples(n=4, seed=seed))


@pytest.mark.parametrize("weights, settings", [(False, {}), (True, {}), (True, {"use_distributed_optimizer": True}),
                                               (True, {"bf16": True})],
                         ids=["optimizer-state", "offload-train", "offload-train-distributed", "offload-train-bf16"])
def test_an_offloading_trainer_updates_its_weights_as_one_that_keeps_its_state(tmp_path, weights, settings):
    """Bit for bit: the bytes that went to the host come back unchanged; megatron's views into its buffers (a
    parameter in the distributed optimizer's buffer, the optimizer's shard of it) see them again."""
    make_tiny(tmp_path, seed=6)
    (initial, kept), (_, offloaded) = (trainer_updates(str(tmp_path), on, weights, **settings) for on in (False, True))
    assert any(not torch.equal(v, initial[k]) for k, v in kept.items())  # the steps moved the weights
    assert all(torch.equal(v, kept[k]) for k, v in offloaded.items())


def test_an_offloaded_trainer_pushes_the_weights_it_holds_and_leaves_them_on_the_host(tmp_path):
    """--offload-train: the push after a step (which comes after the offload) reads the weights back from the
    host, sends what a trainer that keeps them sends, and frees them again."""
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer

    make_tiny(tmp_path, seed=6)
    trainer = Trainer(TrainerConfig(lr=1e-2, micro_batch_size=4), str(tmp_path))
    trainer.train_step(_batch(1))
    kept = dict(trainer.named_hf_weights())
    trainer.offload(weights=True)
    assert all(p.untyped_storage().nbytes() == 0 for p in trainer.model.parameters())
    pushed = dict(trainer.named_hf_weights())
    assert pushed.keys() == kept.keys() and all(torch.equal(pushed[k], v) for k, v in kept.items())
    assert all(p.untyped_storage().nbytes() == 0 for p in trainer.model.parameters())


@pytest.mark.parametrize("extra, needles", [
    (["--rollout-release-weights", "--no-sync-draft-weights"], ["--rollout-release-weights", "draft would be lost"]),
    (["--rollout-release-kv-cache", "true", "--async-rollout"], ["--rollout-release-kv-cache", "--async-rollout"]),
    (["--offload-optimizer-state", "--debug-rollout-only"], ["--offload-optimizer-state", "--debug-rollout-only"]),
], ids=["weights-without-draft-sync", "async", "debug"])
def test_memory_turns_without_turns_are_refused_in_one_line(ckpt, tmp_path, extra, needles):  # noqa: F811
    refused(args_for(ckpt, tmp_path, *extra), *needles)


@pytest.mark.parametrize("flag", [["--rollout-release-kv-cache", "true"], ["--rollout-release-weights"]])
def test_vllm_on_its_cpu_build_refuses_memory_turns_in_one_line_saying_why(ckpt, tmp_path, flag):  # noqa: F811
    pytest.importorskip("vllm")
    refused(args_for(ckpt, tmp_path, "--rollout-backend", "vllm", *flag), flag[0], "sleep mode", "CPU build")


def test_with_steps_run_as_graphs_a_release_drops_them_and_the_engine_decodes_as_a_fresh_one(engine_ckpt):
    """The graphs captured on the released caches and fused weights are dropped (the `trace` capture
    stands in for CUDA graphs on CPU: tests/test_engine_steps.py); what decodes after the push equals
    a fresh engine's output."""
    from tests.test_engine_steps import traced

    if "deepseek" in engine_ckpt:
        pytest.skip("one family shows the graphs dropped; the caches of each kind are covered above")
    prompts = prompt_ids(engine_ckpt, n=4)
    reference = greedy(build_engine(engine_ckpt, SPEC, EngineConfig(max_batch_size=4)), prompts)
    engine = traced(build_engine(engine_ckpt, SPEC, EngineConfig(max_batch_size=4)))
    assert greedy(engine, prompts) == reference and engine.steps.captured
    engine.release_memory(weights=True)
    assert not engine.steps.captured
    _, state, _ = load_hf_checkpoint(engine_ckpt)
    engine.load_weights(state.items(), version=1)
    assert greedy(engine, prompts) == reference and engine.steps.captured
