"""Spawned ranks of the TP=2 test (a module so torch.multiprocessing can import it)."""
import torch


def run_tp2(rank, port, hf_dir, ckpt_dir, out_file, cfg_kwargs, seeds):
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.config import TrainerConfig
    from trainer.distributed import init_distributed, teardown
    from trainer.trainer import Trainer
    from trainer_fixtures import make_batch
    from vime.parallel_layout import ParallelLayout

    torch.set_num_threads(1)
    init_distributed(rank, 2, "127.0.0.1", port, ParallelLayout(tp=2))
    trainer = Trainer(TrainerConfig(tensor_model_parallel_size=2, **cfg_kwargs), hf_dir)
    logprobs = trainer.compute_logprobs(make_batch(seed=seeds[0]))
    metrics = [trainer.train_step(make_batch(seed=s)) for s in seeds]
    weights = dict(trainer.named_hf_weights())
    trainer.save(ckpt_dir)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights, "logprobs": logprobs}, out_file)
    teardown()
