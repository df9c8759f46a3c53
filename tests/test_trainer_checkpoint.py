"""torch_dist save -> load -> next step reproduces the uninterrupted run (optimizer state included)."""
from trainer.config import TrainerConfig
from trainer.trainer import Trainer
from trainer_fixtures import make_batch, make_tiny

KEYS = ("train/policy_loss", "train/mtp_loss", "train/grad_norm", "train/mtp_grad_norm")


def test_save_load_next_step_equals_uninterrupted_run(tmp_path):
    make_tiny(tmp_path / "hf", seed=4)
    cfg = TrainerConfig(lr=1e-2, enable_mtp_training=True, micro_batch_size=2)
    batches = [make_batch(seed=s) for s in range(3)]
    run = Trainer(cfg, str(tmp_path / "hf"))
    run.train_step(batches[0])
    run.save(str(tmp_path / "ckpt"))
    uninterrupted = [run.train_step(b) for b in batches[1:]]

    resumed = Trainer(cfg, str(tmp_path / "hf"), load=str(tmp_path / "ckpt"))
    after_load = [resumed.train_step(b) for b in batches[1:]]
    for want, got in zip(uninterrupted, after_load):
        assert {k: got[k] for k in KEYS} == {k: want[k] for k in KEYS}
    assert uninterrupted[0]["train/policy_loss"] != 0.0
    assert all(p.equal(q) for p, q in zip(run.model.parameters(), resumed.model.parameters()))
