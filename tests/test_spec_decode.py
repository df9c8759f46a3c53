"""Speculative decoding is lossless: greedy outputs and log-probs equal plain decoding for
every proposer, drafts really get accepted, cached MTP drafting equals the naive recompute,
and the target as its own draft model is accepted (almost) always."""
import dataclasses

import pytest
import torch

from vime.models.families import MTP_FAMILIES
from rollout.embedded.engine import Engine, EngineConfig
from vime.sample import samples_for_prompts
from rollout.embedded.proposers.mtp import MTPProposer
from tests.mtp_oracles import reference_mtp_drafts
from rollout.sampling_params import SamplingParams
from rollout.embedded.engine_builder import build_engine, build_proposer
from vime.spec_config import parse_spec_config
from rollout.spec_stats import aggregate_spec_stats
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from fp32_bounds import close, greedy_logprob_bound, max_logprob_diff, reduction_rtol
from rollout.embedded.proposers.draft_model import DraftModelProposer
from rollout.embedded.spec_policy import FixedK, ScheduleK
from spec_fixtures import SMALL, markov_model, save_checkpoint, one_thread  # noqa: F401

GREEDY = SamplingParams(temperature=0, max_new_tokens=20)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(MTP_FAMILIES))
def markov_ckpt(request, tmp_path_factory):
    return save_checkpoint(markov_model(noise=0.2, family=request.param), str(tmp_path_factory.mktemp("markov")))


@pytest.fixture(scope="module")
def prompts(markov_ckpt):
    codec = TextCodec(markov_ckpt)
    return [[1] + codec.encode(r["prompt"]) for r in make_prompts(100, seed=11)]


@pytest.fixture(scope="module")
def plain(markov_ckpt, prompts):
    return build_engine(markov_ckpt, None, EngineConfig(max_batch_size=100)).generate(samples_for_prompts(prompts), GREEDY)


@pytest.fixture(scope="module")
def logprob_bound(markov_ckpt, plain):
    """How far two fp32 greedy runs of the Markov model may differ in log-prob (reduction order only)."""
    return greedy_logprob_bound(markov_ckpt, plain)


def spec_for(method, k, ckpt):
    raw = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        raw["model"] = ckpt
    return raw


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("method", ["mtp", "ngram", "suffix", "draft_model"])
def test_greedy_speculative_equals_plain_decoding_with_equal_logprobs(method, k, markov_ckpt, prompts, plain,
                                                                     logprob_bound):
    engine = build_engine(markov_ckpt, spec_for(method, k, markov_ckpt), EngineConfig(max_batch_size=100))
    spec = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain]
    assert max_logprob_diff(spec, plain) <= logprob_bound
    stats = aggregate_spec_stats(spec)
    assert stats["spec_accepted_tokens"] > 0  # drafts were really accepted: the test is not vacuous
    assert stats["spec_accept_length"] > 1.0


@pytest.mark.parametrize("adaptive", [False, True])
def test_strict_sampled_speculation_reproduces_plain_sampling_token_for_token(markov_ckpt, prompts, adaptive):
    # the uniform deciding each output position is keyed to that position, so strict
    # verification (accept a draft iff it equals the target's sample) emits exactly what plain
    # sampling emits; fp64 keeps verify-vs-plain rounding (~1e-16) away from every sampling
    # boundary, so the equality holds on any CPU
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)
    cfg = EngineConfig(max_batch_size=16, dtype=torch.float64)
    plain = build_engine(markov_ckpt, None, cfg).generate(samples_for_prompts(prompts), sampling)
    for k in (1, 3):
        raw = dict(spec_for("mtp", k, markov_ckpt), rejection_sample_method="strict")
        spec = build_engine(markov_ckpt, raw, cfg, adaptive=adaptive).generate(samples_for_prompts(prompts), sampling)
        assert [s.response_ids for s in spec] == [s.response_ids for s in plain]
        if not adaptive:  # (adaptive may rightly stop drafting on this model)
            assert aggregate_spec_stats(spec)["spec_accepted_tokens"] > 0
    assert len({tuple(s.response_ids) for s in plain}) > len(prompts) // 2  # really sampled, not near-greedy
    # negative control: probabilistic verification is exact in distribution, but its correction
    # after a rejection comes from the residual max(p - q, 0), so its tokens differ
    raw = dict(spec_for("mtp", 1, markov_ckpt), rejection_sample_method="probabilistic")
    other = build_engine(markov_ckpt, raw, cfg).generate(samples_for_prompts(prompts), sampling)
    assert [s.response_ids for s in other] != [s.response_ids for s in plain]


def test_plain_baseline_times_the_same_batch_and_leaves_the_speculative_call_untouched(markov_ckpt, prompts):
    from rollout.backend import EmbeddedBackend

    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)
    spec = dict(spec_for("mtp", 2, markov_ckpt), rejection_sample_method="strict")
    alone = EmbeddedBackend(markov_ckpt, spec, 16)
    expected = alone.generate(samples_for_prompts(prompts), sampling)
    plain = build_engine(markov_ckpt, None, EngineConfig(max_batch_size=16)).generate(samples_for_prompts(prompts), sampling)
    reproduced = sum(p.response_ids == e.response_ids for p, e in zip(plain, expected)) / len(prompts)
    backend = EmbeddedBackend(markov_ckpt, spec, 16)
    for plain_first in (True, False, True):  # the proposer's caches survive plain passes on either side
        got = samples_for_prompts(prompts)
        out = backend.generate_with_plain_baseline(got, sampling, plain_first)
        assert [s.response_ids for s in got] == [s.response_ids for s in expected]
        assert [s.rollout_logprobs for s in got] == [s.rollout_logprobs for s in expected]
        assert backend.stats()["spec"] == alone.stats()["spec"]  # stats are the speculative call's
        assert backend.stats()["seconds"] != out["plain_seconds"] and out["plain_seconds"] > 0
        assert out["plain_same_responses"] == reproduced
    assert alone.stats()["spec"]["accepted_tokens"] > 0


def test_draft_model_that_is_the_target_is_accepted_at_least_98_percent(markov_ckpt, prompts):
    engine = build_engine(markov_ckpt, spec_for("draft_model", 3, markov_ckpt), EngineConfig(max_batch_size=100))
    stats = aggregate_spec_stats(engine.generate(samples_for_prompts(prompts), GREEDY))
    assert stats["spec_accept_rate"] >= 0.98
    assert stats["spec_accept_length"] > 3.0


class _Checked:
    """Wraps the MTP proposer: after every propose, compare with the no-cache recompute."""

    def __init__(self, inner):
        self.inner, self.checked, self.mismatches = inner, 0, 0
        self.num_speculative_tokens = inner.num_speculative_tokens

    def attach(self, engine):
        self.inner.attach(engine)
        self.model = engine.model

    def propose(self, out):
        self.inner.propose(out)
        for r in out.requests:
            self.checked += 1
            self.mismatches += r.drafts != reference_mtp_drafts(self.model, r.all_ids, len(r.drafts))

    def __getattr__(self, name):  # everything else the engine asks of a proposer: the wrapped one's
        return getattr(self.inner, name)


@pytest.mark.parametrize("family", sorted(MTP_FAMILIES))
@pytest.mark.parametrize("layers, k", [(1, 3), (2, 3), (3, 4)])
@pytest.mark.parametrize("cycling", [False, True])
def test_cached_mtp_drafting_equals_drafting_recomputed_without_cache(tmp_path, layers, k, family, cycling):
    """k > layers continues past the last layer; one-token prompts start with deeper layers empty;
    cycling k through 0..k defers catch-ups (k = 0 steps) and varies the chain length."""
    model = markov_model(noise=0.2, mtp_noise=0.3, num_nextn_predict_layers=layers, family=family)
    proposer = _Checked(build_proposer(parse_spec_config({"method": "mtp", "num_speculative_tokens": k})))
    engine = Engine(model, EngineConfig(max_batch_size=8), proposer=proposer)
    if cycling:
        engine.k_policy = CyclingK(k)
    prompts = [[1, 5 + i, 7, 9 + i % 3][: 1 + i % 4] for i in range(8)]
    samples = engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=12))
    assert proposer.checked > 8 * 4
    assert proposer.mismatches == 0
    stats = aggregate_spec_stats(samples)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # both branches were exercised


def test_a_generate_that_drafts_at_no_step_defers_nothing_and_the_next_drafts_as_recomputed():
    """A schedule of k = 0 at every batch size keeps no hidden states for a catch-up (none can come in that
    generate); the next generate, drafting at every step, drafts what drafting recomputed without a cache does.
    Control: a schedule that drafts at one batch size keeps the states of its steps without drafts."""
    def most_deferred(schedule):
        proposer = _Checked(build_proposer(parse_spec_config({"method": "mtp", "num_speculative_tokens": 2})))
        engine = Engine(markov_model(noise=0.2, mtp_noise=0.3), EngineConfig(max_batch_size=4), proposer=proposer)
        engine.k_policy = ScheduleK(schedule, 2, 4)
        most, inner = [0], proposer.inner.defer

        def defer(out):
            inner(out)
            most[0] = max(most[0], len(proposer.inner.deferred))
        proposer.inner.defer = defer
        prompts = [[1, 5 + i, 7][: 1 + i % 3] for i in range(4)]
        engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=12))
        return most[0], engine, proposer, prompts

    most, engine, proposer, prompts = most_deferred([[1, 4, 0]])
    assert most == 0
    engine.k_policy = FixedK(2)
    engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=12))
    assert proposer.checked > 4 * 4 and proposer.mismatches == 0
    assert most_deferred([[1, 1, 2], [2, 4, 0]])[0] > 0


def test_sampled_mtp_drafts_carry_their_draft_distribution(tmp_path):
    model = markov_model(noise=0.2)
    spec = parse_spec_config({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "probabilistic"})
    engine = Engine(model, EngineConfig(max_batch_size=4, rejection_sample_method="probabilistic"),
                    proposer=MTPProposer(spec, sample_drafts=True))
    seen = []
    inner = engine.proposer.propose

    def spy(out):
        inner(out)
        seen.extend((r.drafts, r.draft_probs) for r in out.requests)

    engine.proposer.propose = spy
    engine.generate(samples_for_prompts([[1, 5, 6], [1, 7]]), SamplingParams(temperature=1.0, max_new_tokens=6))
    assert seen and all(q is not None and q.shape == (2, model.cfg.vocab_size) for _, q in seen)
    assert all(torch.allclose(q.sum(-1), torch.ones(2)) for _, q in seen)
    assert all(float(q[i, d]) > 0 for drafts, q in seen for i, d in enumerate(drafts))
    # greedy requests draft deterministically: the verifier treats q as one-hot
    engine.generate(samples_for_prompts([[1, 5, 6]]), SamplingParams(temperature=0, max_new_tokens=4))
    assert seen[-1][1] is None


def test_speculation_never_runs_past_max_new_tokens(markov_ckpt, prompts):
    engine = build_engine(markov_ckpt, spec_for("ngram", 3, markov_ckpt), EngineConfig(max_batch_size=100))
    out = engine.generate(samples_for_prompts(prompts[:20]), SamplingParams(temperature=0, max_new_tokens=5))
    assert all(len(s.response_ids) <= 5 for s in out)


def test_sampled_draft_model_equal_to_the_target_is_accepted_at_temperature_one(markov_ckpt, prompts):
    """Sampled drafts carry q; with q == p the probabilistic test min(1, p/q) keeps every draft."""
    from rollout.embedded.proposers.draft_model import DraftModelProposer

    spec = parse_spec_config({"method": "draft_model", "num_speculative_tokens": 3, "model": markov_ckpt,
                              "rejection_sample_method": "probabilistic"})
    engine = build_engine(markov_ckpt, spec, EngineConfig(max_batch_size=50, rejection_sample_method="probabilistic"))
    engine.set_proposer(DraftModelProposer(spec, sample_drafts=True))
    stats = aggregate_spec_stats(engine.generate(samples_for_prompts(prompts[:50]), SamplingParams(temperature=1.0,
                                                                                            max_new_tokens=16)))
    assert stats["spec_accept_rate"] >= 0.98


@pytest.mark.parametrize("method", ["mtp", "draft_model", "suffix"])
def test_speculation_with_reused_slots_equals_plain_decoding(method, markov_ckpt, prompts, plain):
    """Few slots: finished requests hand their slot (and the proposer's cache rows) to new ones."""
    engine = build_engine(markov_ckpt, spec_for(method, 3, markov_ckpt), EngineConfig(max_batch_size=7))
    spec = engine.generate(samples_for_prompts(prompts[:40]), GREEDY)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain[:40]]


def test_accepted_drafts_cut_off_by_a_stop_token_still_count(markov_ckpt, prompts, plain):
    # the draft is the target, so the first verify step accepts its 3 drafts; a stop token at the
    # first of them keeps 1 of them in the output, yet the verify accepted 3, and acceptance counts
    # what the verify accepted (vLLM's definition, so both backends' metrics mean the same)
    engine = build_engine(markov_ckpt, spec_for("draft_model", 3, markov_ckpt), EngineConfig(max_batch_size=4))
    accepted, kept = [], []
    for ids, ref in list(zip(prompts, plain))[:12]:
        stop = ref.response_ids[1]
        if stop == ref.response_ids[0]:
            continue
        out = engine.generate(samples_for_prompts([ids]), dataclasses.replace(GREEDY, stop_token_ids=(stop,)))[0]
        assert out.response_ids == ref.response_ids[:2] and out.finish_reason == "stop"
        assert out.spec.accepted_tokens <= 3  # never more than the one verify step drafted
        accepted.append(out.spec.accepted_tokens)
        kept.append(len(out.response_ids) - 1)  # the prefill token is never a draft
    # counting only what reached the output would give at most `kept`: here the cut drafts count too
    assert sum(accepted) > sum(kept) > 0


class CyclingK(FixedK):
    """A k policy that walks 0, 1, ..., K, 0, ... across steps: every k, and every switch
    between them (deferred MTP catch-up included), gets exercised."""

    def __init__(self, k_max):
        super().__init__(k_max)
        self.step = -1

    def choose(self, batch_size):
        self.step += 1
        return self.step % (self.k + 1)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("policy", ["adaptive", "cycling", "schedule"])
def test_greedy_with_k_chosen_per_step_equals_plain_decoding(method, policy, markov_ckpt, prompts, plain, logprob_bound):
    raw = spec_for(method, 3, markov_ckpt)
    if policy == "schedule":  # 100 prompts in 16 slots: the batch drains through every range
        raw["num_speculative_tokens_per_batch_size"] = [[1, 3, 3], [4, 9, 1], [10, 16, 2]]
    engine = build_engine(markov_ckpt, raw, EngineConfig(max_batch_size=16), adaptive=policy == "adaptive")
    if policy == "cycling":
        engine.k_policy = CyclingK(3)
    spec = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain]
    assert max_logprob_diff(spec, plain) <= logprob_bound
    if policy != "adaptive":  # adaptive may rightly find that nothing pays on this model
        assert aggregate_spec_stats(spec)["spec_accepted_tokens"] > 0
    else:
        st = engine.stats()
        assert 0 <= st["spec_k_mean"] <= 3 and st["spec_predicted_speedup"] > 0 and st["spec_measured_speedup"] > 0


def test_schedule_drafts_the_k_of_the_live_batch_size(markov_ckpt, prompts):
    raw = dict(spec_for("ngram", 3, markov_ckpt), num_speculative_tokens_per_batch_size=[[1, 4, 0], [5, 64, 2]])
    engine = build_engine(markov_ckpt, raw, EngineConfig(max_batch_size=8))
    seen = []
    choose = engine.k_policy.choose
    engine.k_policy.choose = lambda b: seen.append((b, choose(b))) or seen[-1][1]
    samples = engine.generate(samples_for_prompts(prompts[:20]), GREEDY)
    assert all(k == (0 if b <= 4 else 2) for b, k in seen) and {b for b, _ in seen} >= {8, 4}  # 20 = 8 + 8 + 4
    assert max(len(s.spec.drafted_per_pos) for s in samples) <= 2


def test_synthetic_acceptance_holds_its_per_position_rates_at_temperature_zero(markov_ckpt, prompts):
    rates = [0.8, 0.5, 0.2]  # vLLM's meaning: P(first i+1 drafts accepted)
    raw = dict(spec_for("mtp", 3, markov_ckpt), rejection_sample_method="synthetic",
               synthetic_acceptance_rates=rates)
    samples = build_engine(markov_ckpt, raw, EngineConfig(max_batch_size=100)).generate(
        samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=40))
    for i, want in enumerate(rates):
        # per position: drafted vs accepted-with-all-before (the unconditional rate)
        full = [(s.spec.drafted_per_pos[i], s.spec.accepted_per_pos[i]) for s in samples]
        n, acc = sum(d for d, _ in full), sum(a for _, a in full)
        # binomial: 5 standard deviations around the set rate
        assert abs(acc / n - want) <= 5 * (want * (1 - want) / n) ** 0.5 + 0.02, (i, acc / n, want)


def test_cli_spec_adaptive_without_speculation_exits_2_with_one_line(tmp_path, markov_ckpt):
    import subprocess
    import sys

    (tmp_path / "p.jsonl").write_text('{"prompt": "12+34="}\n')
    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    res = subprocess.run([sys.executable, "-m", "rollout.generate", "--hf-checkpoint", markov_ckpt, "--prompts",
                          str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "o.jsonl"), "--spec-adaptive"],
                         cwd=root, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "--spec-adaptive" in res.stderr


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_requests_ending_apart_leave_no_holes_and_moving_them_changes_no_draft_or_output(method):
    """Requests stop at different steps (a stop token met at different points of the model's
    token cycle) and more wait than there are slots. With slot compaction every decoding step
    reads consecutive slots (without it holes appear, so the test is not vacuous); the MTP drafts of
    moved requests equal the no-cache recompute (caches, carry and deferred catch-up moved, k
    cycling through 0..3) and the outputs equal those of the engine that leaves holes."""
    model = markov_model(noise=0.2, mtp_noise=0.3)
    prompts = [[1, 3 + i % 25, 4 + i % 7][: 1 + i % 3] for i in range(24)]
    sampling = SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=(10,))
    raw = {"method": method, "num_speculative_tokens": 3}
    spec = parse_spec_config(raw if method == "mtp" else dict(raw, model="unused: the model is given"))
    runs = {}
    for compact in (True, False):
        proposer = _Checked(MTPProposer(spec)) if method == "mtp" else DraftModelProposer(spec, model=model)
        engine = Engine(model, EngineConfig(max_batch_size=8, compact_slots=compact), proposer=proposer)
        engine.k_policy = CyclingK(3)
        slots_seen, verify_step = [], engine._verify_step

        def spy(reqs, sampling, verify_step=verify_step, slots_seen=slots_seen):
            slots_seen.append([r.slot for r in reqs])
            return verify_step(reqs, sampling)

        engine._verify_step = spy
        samples = engine.generate(samples_for_prompts(prompts), sampling)
        holes = sum(s != list(range(s[0], s[0] + len(s))) for s in slots_seen)
        runs[compact] = samples, holes, proposer
    (moved, no_holes, checked), (kept, holes, _) = runs[True], runs[False]
    assert no_holes == 0 and holes > 0
    assert len({len(s.response_ids) for s in moved}) > 3  # requests really ended apart
    assert [s.response_ids for s in moved] == [s.response_ids for s in kept]
    # same rows, other batch companions: the logits differ by the fp32 bound relative to their size,
    # |z| <= ||head row|| * ||final-normed h|| <= ||head row|| * sqrt(H) * max|norm weight|, and a
    # log-softmax moves by at most twice its logits' largest change
    longest = max(SMALL["intermediate_size"], model.cfg.vocab_size)
    rtol = reduction_rtol(longest, 10 * SMALL["num_hidden_layers"] + 2)
    with torch.no_grad():
        logit_bound = float(model.head_weight().norm(dim=1).max() * SMALL["hidden_size"] ** 0.5
                            * model.model.norm.weight.abs().max())
    assert all(close(a, b, rtol, scale=2 * max(logit_bound, 1.0))
               for s, t in zip(moved, kept) for a, b in zip(s.rollout_logprobs, t.rollout_logprobs))
    if method == "mtp":
        assert checked.checked > len(prompts) and checked.mismatches == 0
