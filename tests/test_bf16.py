"""--bf16 in-process: the bf16 probe, fp32 master weights, the trainer and the engine in bf16
(log-probs within the derived bf16 bound), greedy speculation == plain in bf16, the rejection
sampler's fp32 arithmetic, bf16 weight sync and fp32 checkpoints of a bf16 trainer.

The real --bf16 runs (Ray, megatron on gloo, both backends) are in test_train_rl_bf16.py.
"""
import pytest
import torch

from fp32_bounds import bf16_logprob_bound, max_abs_logit
from mtp.rejection import verify
from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from rollout.spec_stats import aggregate_spec_stats
from spec_fixtures import markov_model, save_checkpoint, one_thread  # noqa: F401
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.model import forward
from trainer.trainer import Trainer
from trainer_fixtures import make_batch, make_tiny
from vime import weight_sync
from vime.errors import UserError
from vime.models.hf_format import read_config
from vime.precision import bf16_matmul_problem, check_bf16
from vime.sample import samples_for_prompts


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16_hf")
    make_tiny(path, seed=1, std=0.3)
    return str(path)


# ---------------------------------------------------------------- the probe (bad input)
def test_the_bf16_probe_passes_on_this_cpu_and_fails_on_a_device_without_a_usable_matmul():
    assert bf16_matmul_problem("cpu") is None
    # the meta device computes shapes only, so the probe cannot read a result back: its failure branch
    assert bf16_matmul_problem("meta")
    with pytest.raises(UserError) as err:
        check_bf16(True, device="meta")
    assert "\n" not in str(err.value) and str(err.value).startswith("--bf16: ") and "drop --bf16" in str(err.value)
    check_bf16(False, device="meta")  # fp32 runs never probe


def test_preflight_refuses_bf16_when_the_matmul_probe_fails_and_accepts_it_here(tmp_path, monkeypatch):
    from bad_input_helpers import refused
    from train_rl import prepare
    from vime.cli_config import load_config

    argv = ["--bf16", "--output-dir", str(tmp_path), "--num-rollout", "1"]
    prepare(load_config(argv))  # the negative control: this CPU runs bf16 matmuls
    monkeypatch.setattr("vime.precision.bf16_matmul_problem", lambda device: "no bf16 GEMM kernel on this build")
    refused(argv, "--bf16", "cannot run a bf16 matmul", "no bf16 GEMM kernel", "drop --bf16")
    prepare(load_config(argv[1:]))  # without --bf16 the probe is never asked


# ---------------------------------------------------------------- fp32 master weights
def _micro_batch_losses(model, xs):
    return [model(x.bfloat16()).float().square().mean() for x in xs]


def test_megatrons_bf16_optimizer_steps_fp32_masters_as_adamw_and_keeps_updates_bf16_would_lose():
    """The trainer's optimizer part under --bf16 (trainer/optimizer.py: megatron's DDP and
    Float16OptimizerWithFloat16Params) against torch's AdamW on fp32 copies given the same bf16 gradients
    summed in fp32: the same masters bit for bit, and bf16 weights that are the masters rounded."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer.distributed import ensure_distributed
    from trainer.optimizer import OptimizerOptions, TrainedPart

    ensure_distributed()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    ref = torch.nn.Parameter(model.weight.detach().float().clone())
    initial = model.weight.detach().clone()
    lr = 1e-4  # an AdamW step moves each weight by ~lr, far below half a bf16 ulp of weights ~0.1
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, use_cpu_initialization=True,
                               bf16=True, params_dtype=torch.bfloat16)
    part = TrainedPart(model, config, OptimizerOptions(bf16=True), lr, weight_decay=0.0, adam_eps=1e-8, clip_grad=0)
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    plain = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    plain.weight.data.copy_(initial)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(5):
        xs = torch.randn(2, 4, 16).unbind(0)  # two micro-batches accumulate into one step
        # the reference: the same bf16 gradients, summed in fp32, stepped by torch's own AdamW
        ref.grad = sum(torch.autograd.grad(l, model.weight)[0].float() for l in _micro_batch_losses(model, xs))
        part.zero_grad()
        for loss in _micro_batch_losses(model, xs):
            loss.backward()
        assert model.weight.grad is None and model.weight.main_grad.dtype == torch.float32  # added to the fp32 one
        part.finish_gradients()
        part.step()
        ref_opt.step()
        plain_opt.zero_grad()
        sum(_micro_batch_losses(plain, xs)).backward()
        plain_opt.step()
    master = model.weight.main_param
    assert torch.equal(master, ref)
    assert master.dtype == torch.float32 and model.weight.dtype == torch.bfloat16
    assert torch.equal(model.weight, ref.detach().to(torch.bfloat16))  # the masters, rounded
    # the negative control: AdamW on the bf16 parameters themselves rounds most updates away
    lost = (plain.weight == initial).float().mean().item()
    kept = (master.detach() != initial.float()).float().mean().item()
    assert lost > 0.5 and kept > 0.99, (lost, kept)


# ---------------------------------------------------------------- trainer and engine in bf16
def test_bf16_trainer_holds_bf16_params_and_fp32_masters_and_trains(hf_dir):
    trainer = Trainer(TrainerConfig(bf16=True, lr=1e-3), hf_dir)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for g in trainer.optimizer.param_groups for p in g["params"]} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(make_batch())
    assert metrics["train/grad_norm"] > 0
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > len(before) // 2
    for p in trainer.policy_params():  # every bf16 weight is its master rounded (megatron's `main_param`)
        assert torch.equal(p, p.main_param.detach().to(torch.bfloat16))


def batch_and_logprob_bound(trainer, cfg, samples, temperature):
    """The trainer's batch of `samples` and the bf16 log-prob bound derived for it (the bound scales
    with the largest logit the trainer's bf16 forward gives on these tokens)."""
    for s in samples:
        s.advantage = 1.0
    batch = build_batch(samples)
    with torch.no_grad():
        logits = forward(trainer.model, batch.tokens).logits
    tol = bf16_logprob_bound(cfg.num_hidden_layers, max(cfg.intermediate_size, cfg.hidden_size, cfg.vocab_size),
                             logits.abs().max().item(), temperature)
    return batch, tol


def test_bf16_trainer_and_bf16_engine_logprobs_agree_within_the_derived_bf16_bound(hf_dir):
    temperature, cfg = 0.7, read_config(hf_dir)
    trainer = Trainer(TrainerConfig(temperature=temperature, bf16=True), hf_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (4 + i,), generator=g).tolist() for i in range(4)]
    engine = Engine.from_checkpoint(hf_dir, EngineConfig(dtype=torch.bfloat16))
    samples = engine.generate(samples_for_prompts(prompts, n=2),
                              SamplingParams(temperature=temperature, max_new_tokens=12, seed=3))
    batch, tol = batch_and_logprob_bound(trainer, cfg, samples, temperature)
    got = trainer.compute_logprobs(batch)
    mask = batch.loss_mask.bool()
    assert (got - batch.rollout_logprobs)[mask].abs().max().item() <= tol
    diff = trainer.backward(batch)["train/logprob_abs_diff"]
    print(f"bf16 trainer vs bf16 engine: logprob_abs_diff {diff:.3g}, derived bound {tol:.3g}")
    assert diff <= tol, (diff, tol)
    # the negative control: a shift of the rollout's log-probs by 2 * tol is seen as such
    batch.rollout_logprobs = batch.rollout_logprobs - 2 * tol * batch.loss_mask
    assert abs(trainer.backward(batch)["train/logprob_abs_diff"] - 2 * tol) <= tol


def test_bf16_checkpoint_holds_the_fp32_masters_and_resumes_with_or_without_bf16(hf_dir, tmp_path):
    trainer = Trainer(TrainerConfig(bf16=True, lr=1e-3), hf_dir)
    for seed in range(2):
        trainer.train_step(make_batch(seed=seed))
    # megatron's fp32 `main_param` of each trained weight (a frozen MTP weight has none: it is its own)
    masters = {n: getattr(p, "main_param", p).detach().clone() for n, p in trainer.model.named_parameters()}
    bf16_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.save(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, bf16_before[n]) for n, p in trainer.model.named_parameters())  # put back
    fp32 = Trainer(TrainerConfig(lr=1e-3), hf_dir, load=str(tmp_path / "ckpt"))
    for n, p in fp32.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, masters[n].float()), n
    again = Trainer(TrainerConfig(bf16=True, lr=1e-3), hf_dir, load=str(tmp_path / "ckpt"))
    for n, p in again.model.named_parameters():
        assert torch.equal(getattr(p, "main_param", p), masters[n]), n
        assert torch.equal(p, bf16_before[n]), n
    # the resumed bf16 trainer takes the same next step as the one that saved
    batch = make_batch(seed=7)
    trainer.train_step(batch)
    again.train_step(batch)
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(p, q), n


# ---------------------------------------------------------------- weight sync as bf16
def test_bf16_weights_go_on_the_wire_as_bf16_and_the_engine_fingerprint_sums_what_was_sent(hf_dir):
    from rollout.backend import EmbeddedBackend

    trainer = Trainer(TrainerConfig(bf16=True, lr=1e-3, enable_mtp_training=True, mtp_num_layers=1), hf_dir)
    trainer.train_step(make_batch())
    sent = [(k, v.detach().cpu()) for k, v in trainer.named_hf_weights()]
    layout = weight_sync.bucket_layout(sent, 1 << 20)
    assert {s.dtype for bucket in layout for s in bucket} == {torch.bfloat16}
    flat = [weight_sync.flatten_bucket(b, dict(sent)) for b in layout]
    received = [pair for b, f in zip(layout, flat) for pair in weight_sync.unflatten_bucket(b, f)]
    backend = EmbeddedBackend(hf_dir, {"method": "mtp", "num_speculative_tokens": 2}, 8, dtype=torch.bfloat16)
    before = backend.fingerprint()
    backend.load_weights(received, version=1)
    n = read_config(hf_dir).num_hidden_layers
    from vime.models.draft_kinds import is_draft_name

    fp = backend.fingerprint()
    assert fp["target"] == weight_sync.checksum([(k, v) for k, v in sent if not is_draft_name(k, n)])
    assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in sent if is_draft_name(k, n)])
    assert fp != before  # the step changed the weights: the comparison is not of two initial states
    assert backend.digests() == weight_sync.digests(sent)  # --check-weight-update-equal: the bf16 bit patterns


# ---------------------------------------------------------------- speculation and the sampler in bf16
@pytest.fixture(scope="module")
def markov_ckpt(tmp_path_factory):
    return save_checkpoint(markov_model(noise=0.2), str(tmp_path_factory.mktemp("bf16_markov")))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method, k", [("mtp", 1), ("mtp", 3), ("ngram", 2)])
def test_greedy_speculative_equals_plain_decoding_token_for_token_in_bf16(markov_ckpt, method, k):
    from rollout.task import make_prompts
    from rollout.tokenizer import TextCodec

    codec = TextCodec(markov_ckpt)
    prompts = [[1] + codec.encode(r["prompt"]) for r in make_prompts(40, seed=11)]
    greedy = SamplingParams(temperature=0, max_new_tokens=20)
    bf16 = EngineConfig(max_batch_size=40, dtype=torch.bfloat16)
    plain = build_engine(markov_ckpt, None, bf16).generate(samples_for_prompts(prompts), greedy)
    spec = build_engine(markov_ckpt, {"method": method, "num_speculative_tokens": k}, bf16).generate(
        samples_for_prompts(prompts), greedy)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain]
    assert aggregate_spec_stats(spec)["spec_accepted_tokens"] > 0  # drafts were accepted: not vacuous
    cfg = read_config(markov_ckpt)
    tol = bf16_logprob_bound(cfg.num_hidden_layers, max(cfg.intermediate_size, cfg.hidden_size, cfg.vocab_size),
                             max_abs_logit(markov_ckpt, plain), 1.0)
    diff = max(abs(a - b) for s, p in zip(spec, plain) for a, b in zip(s.rollout_logprobs, p.rollout_logprobs))
    assert diff <= tol
    # the engine really ran in bf16: its log-probs are not the fp32 engine's
    fp32 = build_engine(markov_ckpt, None, EngineConfig(max_batch_size=40)).generate(samples_for_prompts(prompts), greedy)
    assert any(a != b for s, p in zip(fp32, plain) for a, b in zip(s.rollout_logprobs, p.rollout_logprobs))


@pytest.mark.parametrize("method", ["probabilistic", "strict"])
def test_the_rejection_sampler_computes_in_fp32_on_bf16_inputs(method):
    g = torch.Generator().manual_seed(0)
    b, k, v = 512, 3, 32
    logprobs = torch.log_softmax(2 * torch.randn(b, k + 1, v, generator=g), -1).bfloat16()
    q = torch.softmax(2 * torch.randn(b, k, v, generator=g), -1).bfloat16()
    drafts = torch.multinomial(q.float().reshape(-1, v), 1, generator=g).view(b, k)
    counts = torch.full((b,), k)
    u = torch.rand(b, k + 2, generator=g)
    got = verify(logprobs, drafts, counts, u, False, method, q)
    want = verify(logprobs.float(), drafts, counts, u, False, method, q.float())  # the reference: fp32 inputs
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.emitted, want.emitted)
    assert got.emitted_logprobs.dtype == torch.float32 and torch.equal(got.emitted_logprobs, want.emitted_logprobs)
    assert 0 < got.num_accepted.float().mean().item() < k  # acceptances and rejections both happen


# ---------------------------------------------------------------- the online EAGLE-3 draft in bf16
def test_the_online_eagle3_draft_trains_in_bf16_on_fp32_masters_and_syncs_bit_for_bit(tmp_path):
    from draft_kind_fixtures import random_draft
    from rollout.backend import EmbeddedBackend
    from vime.models.eagle3 import EAGLE3
    from vime.spec_config import parse_spec_config

    target = str(tmp_path / "target")
    make_tiny(target, seed=1, std=0.3, family="qwen2", num_nextn_predict_layers=0)
    draft = random_draft(EAGLE3, read_config(target), seed=2, std=0.05, layers=(0, 1, 2))
    draft_dir = str(tmp_path / "draft")
    EAGLE3.save(draft_dir, draft.cfg, draft.state_dict())
    spec = {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": 2}
    trainer = Trainer(TrainerConfig(bf16=True, enable_draft_training=True, speculative_config=parse_spec_config(spec),
                                    micro_batch_size=2), target)
    d = trainer.draft
    assert {p.dtype for p in d.module.parameters()} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in d.module.named_parameters()}
    metrics = trainer.train_step(make_batch())
    assert metrics["train/draft_grad_norm"] > 0 and metrics["train/draft_1_loss"] > 0
    for n, p in d.module.named_parameters():
        main = p.main_param
        assert main.dtype == torch.float32 and torch.equal(p, main.detach().to(torch.bfloat16)), n
    assert any(not torch.equal(p, before[n]) for n, p in d.module.named_parameters())
    assert {v.dtype for v in d.state()["draft"].values()} == {torch.float32}  # checkpoints keep the masters
    sent = [(k, v.detach().cpu()) for k, v in trainer.named_hf_weights()]
    backend = EmbeddedBackend(target, spec, 4, dtype=torch.bfloat16)
    backend.load_weights(sent, version=1)
    drafted = {k: v for k, v in sent if k.startswith(EAGLE3.wire_prefix)}
    assert drafted and {v.dtype for v in drafted.values()} == {torch.bfloat16}
    assert backend.fingerprint()["draft"] == weight_sync.checksum(list(drafted.items()))


# ---------------------------------------------------------------- vLLM in bf16 (in-process, no Ray)
@pytest.mark.slow
def test_vllm_in_bf16_speculates_exactly_takes_the_bf16_trainers_weights_and_agrees_on_logprobs(tmp_path):
    """vLLM (CPU build) with dtype bfloat16: greedy MTP speculation equals plain greedy decoding; the
    weights of a bf16 trainer step, sent as bf16, are reloaded in place and the fingerprint sums what
    was sent (the bf16 bit patterns too); and the bf16 trainer's log-probs of vLLM's sampled
    responses lie within the derived bf16 bound."""
    pytest.importorskip("vllm")
    from rollout.vllm.backend import VLLMBackend
    from tests.mimo_fixtures import make_tiny_mimo
    from vime.models.draft_kinds import is_draft_name

    ckpt = make_tiny_mimo(str(tmp_path / "mimo"), seed=1)
    cfg = read_config(ckpt)
    prompts = [[1, 5 + i % 20, 7, 9, 4 + i % 7] for i in range(16)]
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    trainer = Trainer(TrainerConfig(bf16=True, lr=1e-3, enable_mtp_training=True, mtp_num_layers=1), ckpt)
    trainer.train_step(make_batch())
    sent = [(k, v.detach().cpu()) for k, v in trainer.named_hf_weights()]
    outs = {}
    for name, spec in (("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 2})):
        backend = VLLMBackend(ckpt, spec, max_batch_size=16, dtype=torch.bfloat16)
        try:
            outs[name] = [s.response_ids for s in backend.generate(samples_for_prompts(prompts), greedy)]
            if spec is None:
                continue
            assert backend.stats()["spec"]["accepted_tokens"] > 0
            backend.load_weights(sent, version=1)
            fp = backend.fingerprint()
            n = cfg.num_hidden_layers
            assert fp["target"] == weight_sync.checksum([(k, v) for k, v in sent if not is_draft_name(k, n)])
            assert fp["draft"] == weight_sync.checksum([(k, v) for k, v in sent if is_draft_name(k, n)])
            assert backend.digests() == weight_sync.digests(sent)
            samples = backend.generate(samples_for_prompts(prompts), SamplingParams(temperature=1.0,
                                                                                     max_new_tokens=16, seed=3))
        finally:
            backend.close()
    assert outs["mtp"] == outs["plain"]
    batch, tol = batch_and_logprob_bound(trainer, cfg, samples, 1.0)
    diff = trainer.backward(batch)["train/logprob_abs_diff"]
    print(f"bf16 trainer vs bf16 vLLM: logprob_abs_diff {diff:.3g}, derived bound {tol:.3g}")
    assert diff <= tol
