"""Sampled speculative decoding with every external draft kind keeps the target's distribution, on the
embedded engine: a 5-token target and a random draft of the kind (draft_kind_fixtures.vocab_pair), the
joint of the first three tokens of 20000 samples against the exact joint by a chi-square test at a
false-alarm rate of 1e-3, for sampled drafts with their q under probabilistic verification and for
argmax drafts under strict verification; a sampler that resamples p instead of the residual fails it.
EAGLE-3 also with a reduced draft vocabulary (3 of the 5 tokens): q is 0 on the two it lacks, which only the
residual then emits."""
import pytest

from draft_kind_fixtures import vocab_pair
from eagle3_fixtures import reduced_draft
from rollout.embedded.proposers import PROPOSERS
from vime.spec_config import parse_spec_config
from spec_fixtures import check_sampled_drafts_keep_the_target_distribution, check_the_test_rejects_resampling_from_p, \
    one_thread  # noqa: F401
from vime.models.draft_kinds import EXTERNAL_KINDS
from vime.models.eagle3 import EAGLE3

pytestmark = pytest.mark.usefixtures("one_thread")
N, ALPHA, K = 20000, 1e-3, 2
# (kind, the target ids of a reduced draft vocabulary or None: the whole vocabulary)
DRAFTS = [(kind, None) for kind in EXTERNAL_KINDS] + [(EAGLE3, (0, 1, 2))]


@pytest.fixture(scope="module", params=DRAFTS, ids=lambda d: d[0].name + ("" if d[1] is None else "-vocab3"))
def pair(request):
    """(kind, the 5-token target, a random draft of the kind drafting K tokens, cut down to the reduced
    vocabulary if one is given)."""
    kind, ids = request.param
    target, draft = vocab_pair(kind, K)
    return kind, target, draft if ids is None else reduced_draft(draft, ids)


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
