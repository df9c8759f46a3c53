"""The top layer: what runs in the driver (Ray actor handles, the weight-sync protocol, Ray start-up).

It may import every package below it (vime, mtp, rollout, trainer, checkpoint_convert);
nothing below imports it. train_rl.py's loop calls one method of these per stage.
"""
