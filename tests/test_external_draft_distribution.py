"""Sampled speculative decoding with every external draft kind keeps the target's distribution, on the
embedded engine: a 5-token target and a random draft of the kind (draft_kind_fixtures.vocab_pair), the
joint of the first three tokens of 20000 samples against the exact joint by a chi-square test at a
false-alarm rate of 1e-3, for sampled drafts with their q under probabilistic verification and for
argmax drafts under strict verification; a sampler that resamples p instead of the residual fails it."""
import pytest

from draft_kind_fixtures import vocab_pair
from rollout.embedded.proposers import PROPOSERS
from vime.spec_config import parse_spec_config
from spec_fixtures import check_sampled_drafts_keep_the_target_distribution, check_the_test_rejects_resampling_from_p, \
    one_thread  # noqa: F401
from vime.models.draft_kinds import EXTERNAL_KINDS

pytestmark = pytest.mark.usefixtures("one_thread")
N, ALPHA, K = 20000, 1e-3, 2


@pytest.fixture(scope="module", params=EXTERNAL_KINDS, ids=lambda kind: kind.name)
def pair(request):
    """(kind, the 5-token target, a random draft of the kind drafting K tokens)."""
    return (request.param, *vocab_pair(request.param, K))


def proposer(kind, draft, method, sample_drafts):
    spec = parse_spec_config({"method": kind.name, "num_speculative_tokens": K, "model": "unused",
                              "rejection_sample_method": method})
    return PROPOSERS[kind.name](spec, draft=draft, sample_drafts=sample_drafts)


@pytest.mark.parametrize("method, sample_drafts", [("probabilistic", True),
                                                   pytest.param("strict", False, marks=pytest.mark.slow)])
def test_sampled_output_with_each_kinds_draft_follows_the_target_distribution(pair, method, sample_drafts):
    kind, target, draft = pair
    check_sampled_drafts_keep_the_target_distribution(target, proposer(kind, draft, method, sample_drafts), method,
                                                      N, ALPHA)


def test_the_distribution_test_rejects_a_sampler_that_resamples_from_p(pair, monkeypatch):
    kind, target, draft = pair
    check_the_test_rejects_resampling_from_p(target, proposer(kind, draft, "probabilistic", True), N, ALPHA,
                                             monkeypatch)
