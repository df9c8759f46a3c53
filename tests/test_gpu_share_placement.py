"""GPU shares in the placement, without a cluster: fractions as Ray takes them, a trainer rank and an
engine packed onto one GPU (with --colocate, or when the cluster has fewer GPUs than ranks + engines),
and fractional placements that cannot be placed refused in one line before Ray starts."""
import functools

import pytest

from orchestration.placement import demand_of, missing_resources
from tests.bad_input_helpers import refused
from tests.test_bad_inputs import args_for, ckpt  # noqa: F401  (ckpt: the bad-input tests' fixture)
from vime.cli_config import load_config

MAIN = ["--enable-mtp-training", "--mtp-num-layers", "1"]  # the README's main command
DP2 = ["--data-parallel-size", "2", "--global-batch-size", "64", "--micro-batch-size", "32"]


@functools.lru_cache(maxsize=None)
def config(argv):
    return load_config(list(argv))


def demand(argv, cluster_gpus):
    return demand_of(config(tuple(argv)), cluster_gpus)


def bundles(argv, cluster_gpus):
    return [(who, bundle) for bundle, who in demand(argv, cluster_gpus).bundles()]


def fits(argv, gpus, cpus=8):
    """Whether the run's bundles fit one node of `gpus` GPUs and `cpus` CPUs."""
    node = {"CPU": cpus, "GPU": gpus}
    return missing_resources(demand(argv, gpus), node, [node]) is None


@pytest.mark.parametrize("argv", [MAIN, MAIN + ["--colocate"],
                                  MAIN + ["--colocate", "--actor-num-gpus-per-node", "0.5",
                                          "--rollout-num-gpus-per-engine", "0.5"]],
                         ids=["main-command", "colocate", "colocate-fractions"])
def test_on_one_gpu_the_rank_and_the_engine_share_one_bundle_of_that_gpu(argv):
    assert bundles(argv, 1) == [(("both", 0), {"CPU": 2.0, "GPU": 1.0})]
    assert fits(argv, 1)
    assert demand(argv, 1).resources("rank", 0)["GPU"] == demand(argv, 1).resources("engine", 0)["GPU"] == 0.5


def test_with_a_gpu_each_nothing_is_packed_and_without_gpus_no_gpu_is_asked_for():
    assert bundles(MAIN, 2) == [(("rank", 0), {"CPU": 1.0, "GPU": 1}), (("engine", 0), {"CPU": 1, "GPU": 1})]
    assert bundles(MAIN, 0) == [(("rank", 0), {"CPU": 1.0}), (("engine", 0), {"CPU": 1})]


def test_packing_pairs_rank_i_with_engine_i_and_leaves_the_rest_a_whole_gpu():
    # 2 ranks + 3 engines on 3 GPUs: two shared GPUs and the third engine alone on the last
    argv = MAIN + DP2 + ["--rollout-num-workers", "3"]
    got = bundles(argv, 3)
    assert [who for who, _ in got] == [("both", 0), ("both", 1), ("engine", 2)]
    assert [b["GPU"] for _, b in got] == [1.0, 1.0, 1]
    assert fits(argv, 3) and not fits(argv, 2)


def test_colocated_whole_gpus_keep_a_gpu_each_in_the_pair():
    argv = MAIN + ["--colocate", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus-per-engine", "1"]
    assert bundles(argv, 2) == [(("both", 0), {"CPU": 2.0, "GPU": 2.0})]


@pytest.mark.parametrize("extra, needles", [
    (["--rollout-num-gpus-per-engine", 1.5], ["--rollout-num-gpus-per-engine 1.5", "at most 1 or whole GPUs"]),
    (["--actor-num-gpus-per-node", 1.5], ["--actor-num-gpus-per-node 1.5", "1.5 GPU each"]),
    (["--colocate", "--actor-num-gpus-per-node", 0.7, "--rollout-num-gpus-per-engine", 0.5],
     ["--colocate", "1.2 GPU", "sum to at most 1"]),
    (["--colocate", "--actor-num-gpus-per-node", 1, "--rollout-num-gpus-per-engine", 0.5],
     ["--colocate", "1.5 GPU", "whole GPUs"]),
    (["--rollout-num-gpus-per-engine", -0.5], ["--rollout-num-gpus-per-engine -0.5: must be >= 0"]),
], ids=["engine-fraction-above-one", "rank-fraction-above-one", "colocated-fractions-overflow",
        "colocated-whole-and-fraction", "negative"])
def test_fractional_placements_that_cannot_be_placed_are_refused_in_one_line(ckpt, tmp_path, extra, needles):  # noqa: F811
    refused(args_for(ckpt, tmp_path, *extra), *needles)


def test_the_in_place_transport_is_chosen_by_where_the_engines_are_not_by_the_flag(ckpt, tmp_path):  # noqa: F811
    refused(args_for(ckpt, tmp_path, "--vllm-weight-transfer", "in_place"), "chosen by itself", "reload")
