"""The KL reference is the initial policy (--hf-checkpoint's weights), also after --load."""
import torch

from trainer.config import TrainerConfig
from vime.net import free_port
from trainer.ray_actor import TrainerActorImpl, node_rendezvous
from trainer_fixtures import random_scored_samples, make_tiny


def started(cfg, hf, load=None):
    actor = TrainerActorImpl(0, 1, cfg, hf, load=load)
    actor.start("127.0.0.1", free_port())
    return actor


def test_kl_reference_after_load_is_the_initial_policy_not_the_resumed_one(tmp_path):
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    make_tiny(hf, seed=4)
    cfg = TrainerConfig(lr=1e-2, use_kl_loss=True, kl_loss_coef=0.1, micro_batch_size=2)
    first = started(cfg, hf)
    initial = {k: v.clone() for k, v in first.ref_state.items()}
    first.train(random_scored_samples(seed=1), 1)
    first.trainer.save(ckpt)
    resumed_weights = {k: v.detach().clone() for k, v in first.trainer.model.state_dict().items() if torch.is_tensor(v)}

    resumed = started(cfg, hf, load=ckpt)
    assert resumed.ref_state.keys() == initial.keys()
    assert all(torch.equal(resumed.ref_state[k], initial[k]) for k in initial)
    model_now = resumed.trainer.model.state_dict()
    assert all(torch.equal(model_now[k], resumed_weights[k]) for k in initial)  # the model itself is resumed
    assert any(not torch.equal(initial[k], resumed_weights[k]) for k in initial)  # and differs from the reference


def test_rendezvous_is_the_node_address_ray_reports_not_loopback():
    import ray.util

    addr, port = node_rendezvous()
    assert addr == ray.util.get_node_ip_address() and 0 < port < 65536
