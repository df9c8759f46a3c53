"""Sampling with speculation follows the target distribution exactly.

A 5-token model at temperature 1: the joint distribution of the first 3 generated tokens
(125 cells) is computed exactly by enumerating prefixes with the model, and 20k
speculative samples (random MTP layer as draft, k=2, so drafts are often rejected) are
compared with it by a chi-square goodness-of-fit test at false-alarm rate 1e-3 per test.
Both draft modes are covered: sampled drafts with their q, and argmax drafts (q one-hot).
A deliberately wrong sampler (on rejection, resample from p instead of the residual
max(p - q, 0)) must fail the same test.
"""

import pytest
import torch

import mtp.rejection as rejection
from rollout.embedded.engine import Engine, EngineConfig
from vime.sample import samples_for_prompts
from rollout.sampling_params import SamplingParams
from rollout.embedded.proposers.mtp import MTPProposer
from rollout.embedded.steps import StepRunner
from vime.spec_config import parse_spec_config
from spec_fixtures import (alternating_k, chi_square_p_value, exact_joint, one_thread, resample_from_p,  # noqa: F401
                           tiny_vocab_model)

N, PROMPT, ALPHA = 20000, [0, 3, 1], 1e-3

pytestmark = pytest.mark.usefixtures("one_thread")


# each family once, and both head layouts between them; each pair drafts with an acceptance
# rate well inside (0.1, 0.9), so both the accept and the residual paths are sampled often
@pytest.fixture(scope="module", params=[("mimo", False), ("qwen3", True)], ids=["mimo-untied", "qwen3-tied"])
def model(request):
    family, tied = request.param
    return tiny_vocab_model(seed=1, family=family, tie_word_embeddings=tied)


def sampled_joint(model, method, sample_drafts=True, k_policy=None, max_batch_size=N, pad_to_buckets=None,
                  graph_steps=False):
    spec = parse_spec_config({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": method})
    config = EngineConfig(max_batch_size=max_batch_size, max_len=16, rejection_sample_method=method,
                          pad_to_buckets=pad_to_buckets)
    engine = Engine(model, config, proposer=MTPProposer(spec, sample_drafts=sample_drafts))
    if graph_steps:  # what a CUDA graph runs, traced whole and replayed from static buffers (steps.py `trace`)
        engine.steps = StepRunner("cpu", graphs=True, max_rows=max_batch_size, capture="trace")
        engine.steps.max_graph_q_len = 1 + spec.num_speculative_tokens
    if k_policy is not None:
        engine.k_policy = k_policy
    samples = engine.generate(samples_for_prompts([PROMPT] * N), SamplingParams(temperature=1.0, max_new_tokens=3, seed=7))
    counts = {}
    for s in samples:
        counts[tuple(s.response_ids[:3])] = counts.get(tuple(s.response_ids[:3]), 0) + 1
    drafted = sum(s.spec.draft_tokens for s in samples)
    accepted = sum(s.spec.accepted_tokens for s in samples)
    return counts, accepted / drafted


def p_value(counts, exact):
    return chi_square_p_value(counts, exact, N)


@pytest.mark.parametrize("method, sample_drafts", [("probabilistic", True),
                                                   pytest.param("probabilistic", False, marks=pytest.mark.slow),
                                                   ("strict", False)])
def test_speculative_sampling_matches_the_target_joint_distribution(model, method, sample_drafts):
    exact = exact_joint(model)
    counts, rate = sampled_joint(model, method, sample_drafts)
    assert 0.1 < rate < 0.9  # drafts are both accepted and rejected, so both paths are exercised
    assert p_value(counts, exact) > ALPHA


@pytest.mark.parametrize("policy", ["adaptive", pytest.param("alternating", marks=pytest.mark.slow)])
def test_sampling_with_k_chosen_per_step_matches_the_target_joint_distribution(model, policy):
    """k changes only how much is drafted: a per-step k (the adaptive policy, or one that
    alternates 0 and 2 so deferred MTP catch-up is exercised) keeps the distribution."""
    from rollout.embedded.spec_policy import AdaptiveK
    from rollout.embedded.step_costs import batch_grid

    class EagerAdaptive(AdaptiveK):
        """The adaptive policy with a constructed profile (a drafted token costs 0.1 of a step on
        1000 rows, 0.6 on none): at its prior acceptance 0.5 it drafts 2 tokens above 800 rows, 1
        down to 200 and none below, so as the last wave drains k falls mid-response whatever this
        CPU's timings."""

        corrects_costs = False  # the constructed profile is the whole price, whatever this CPU's timings

        def prepare(self, engine):
            grid = batch_grid(engine.config.max_batch_size)
            self.set_profile(grid, {k: [1.0 + k * (0.1 + 0.5 * (1 - b / 1000)) for b in grid]
                                    for k in range(self.k + 1)})

    k_policy = EagerAdaptive(2) if policy == "adaptive" else alternating_k()
    # 1000 slots: requests of different waves are at different steps, so k switches mid-response
    counts, rate = sampled_joint(model, "probabilistic", False, k_policy, max_batch_size=1000)
    assert 0.1 < rate < 0.9
    assert p_value(counts, exact_joint(model)) > ALPHA


def padded_steps_joint(model):
    """Sampled with every step padded to batch and key buckets (the shapes CUDA graphs run):
    1000 slots and k alternating 2 / 0, so the batches drain unevenly and most steps carry padding."""
    return sampled_joint(model, "probabilistic", False, alternating_k(), max_batch_size=1000, pad_to_buckets=True)


def graph_steps_joint(model):
    """Sampled with every decode, verify and draft step run as the stand-in for a CUDA graph: traced whole,
    replayed from static input copies into outputs each step family shares (64 slots: row buckets 1 to 64
    as the waves drain; k alternating 2 / 0, so catch-up windows run eagerly between graphed steps)."""
    return sampled_joint(model, "probabilistic", True, alternating_k(), max_batch_size=64, graph_steps=True)


# the step layouts CUDA graphs run: padded (eager) in the default run; graph-shaped (a trace per step
# shape, about half a minute here) among the slow tests
STATIC_STEPS = [pytest.param(padded_steps_joint, id="padded-to-buckets"),
                pytest.param(graph_steps_joint, id="graph-shaped", marks=pytest.mark.slow)]


@pytest.mark.parametrize("static_steps_joint", STATIC_STEPS)
def test_sampling_with_static_steps_matches_the_target_joint_distribution(static_steps_joint):
    model = tiny_vocab_model(seed=1, family="qwen3", tie_word_embeddings=True)
    counts, rate = static_steps_joint(model)
    assert 0.1 < rate < 0.9
    assert p_value(counts, exact_joint(model)) > ALPHA


def test_distribution_test_rejects_a_sampler_that_resamples_from_p(model, monkeypatch):
    monkeypatch.setattr(rejection, "_residual_sample", resample_from_p)
    exact = exact_joint(model)
    counts, _ = sampled_joint(model, "probabilistic")
    assert p_value(counts, exact) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("static_steps_joint", STATIC_STEPS)
def test_distribution_test_with_static_steps_rejects_a_sampler_that_resamples_from_p(static_steps_joint, monkeypatch):
    model = tiny_vocab_model(seed=1, family="qwen3", tie_word_embeddings=True)
    monkeypatch.setattr(rejection, "_residual_sample", resample_from_p)
    counts, _ = static_steps_joint(model)
    assert p_value(counts, exact_joint(model)) < ALPHA


def test_rejection_sampler_keeps_drafts_up_to_each_rows_own_count():
    lp = torch.log_softmax(torch.tensor([[[5.0, 0, 0], [0, 5.0, 0], [0, 0, 5.0]]] * 2), -1)
    drafts = torch.tensor([[0, 1], [0, 1]])
    res = rejection.verify(lp, drafts, torch.tensor([2, 1]), torch.zeros(2, 4), greedy=True)
    assert res.num_accepted.tolist() == [2, 1]
    assert res.emitted[0].tolist() == [0, 1, 2] and res.emitted[1, :2].tolist() == [0, 1]


def test_deterministic_rows_get_one_hot_q_when_the_batch_mixes_them_with_sampled_drafts():
    """A row without q next to a row with q must still be tested as u < p(d), not always kept."""
    from rollout.embedded.engine import Engine as E

    class R:
        def __init__(self, q):
            self.draft_probs = q

    drafts = torch.tensor([[2], [1]])
    engine = E.__new__(E)
    engine.config = EngineConfig()
    q = engine._stack_draft_probs([R(torch.tensor([[0.2, 0.3, 0.5]])), R(None)], drafts, 3)
    assert q[1, 0].tolist() == [0.0, 1.0, 0.0]
    lp = torch.log(torch.tensor([[[0.3, 0.3, 0.4], [1 / 3] * 3]] * 2))
    res = rejection.verify(lp, drafts, torch.tensor([1, 1]), torch.full((2, 3), 0.9), False, "probabilistic", q)
    assert res.num_accepted.tolist() == [0, 0]  # 0.9 * 0.5 >= 0.4 and 0.9 >= 0.3: both rejected
