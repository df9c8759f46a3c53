"""Run monitoring: wandb, metrics.jsonl, tqdm progress, and at the end a PNG of reward and
acceptance length plus a summary table.

wandb's mode, first set wins: --wandb-mode, then WANDB_MODE (wandb's own switch), then online when
WANDB_API_KEY is set, else offline. An online start that fails (no route to the server, a bad
key) is one warning line and the run logs offline (`wandb sync` uploads it later): a run is never
lost for its logger."""
import json
import os
import sys

SUMMARY_KEYS = ("rollout/reward", "rollout/spec_accept_length", "rollout/spec_accept_rate",
                "perf/rollout_tokens_per_s", "train/policy_loss", "train/mtp_loss", "eval/reward",
                "eval/spec_accept_length", "eval/response_len")


def wandb_mode(run_cfg):
    """--wandb-mode > WANDB_MODE > online if a key is set > offline."""
    if run_cfg.wandb_mode:
        return run_cfg.wandb_mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class RunLogger:
    """Writes each step's metrics to metrics.jsonl and wandb, and the summary plot and table at the end.

    A resumed run (`resume_step`, or `rewind` after a trainer restart in-process) logs each step once:
    metrics.jsonl is rewritten from that step on, and wandb, whose rows cannot be taken back, continues
    the run of `resume_id` (the checkpoint's) and is sent only the steps it has not had yet."""

    def __init__(self, run_cfg, config_dict, resume_step=0, resume_id=None):
        self.cfg = run_cfg
        self.dir = run_cfg.output_dir
        os.makedirs(self.dir, exist_ok=True)
        self.jsonl_path = os.path.join(self.dir, "metrics.jsonl")
        logged = self._keep_rows_before(resume_step)
        self.next_step = resume_step
        self.history = []
        self.wandb = self._init_wandb(config_dict, resume_id) if run_cfg.use_wandb else None
        # the steps the wandb run already holds: those of this output dir's log, when it continues that run
        self.wandb_through = logged if resume_id else -1

    @property
    def run_id(self):
        """The wandb run's id (saved with each checkpoint), or None without wandb."""
        return self.wandb.id if self.wandb else None

    def rewind(self, step):
        """Go back to `step` (a trainer restart from its checkpoint): its rows and later ones are dropped
        from metrics.jsonl and from the history; wandb keeps its rows and gets only steps after them."""
        self.wandb_through = max(self.wandb_through, self._keep_rows_before(step))
        self.history = [row for row in self.history if row["rollout/step"] < step]
        self.next_step = step

    def _keep_rows_before(self, step):
        """Rewrite metrics.jsonl keeping the rows of steps before `step` (no duplicated steps); returns
        the last step it held before (-1: none)."""
        if not os.path.exists(self.jsonl_path):
            return -1
        kept, last = [], -1
        with open(self.jsonl_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                last = max(last, row.get("rollout/step", -1))
                if row.get("rollout/step", step) < step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = self.jsonl_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.jsonl_path)
        return last

    def _init_wandb(self, config_dict, resume_id=None):
        import wandb

        mode = wandb_mode(self.cfg)
        options = dict(project=self.cfg.wandb_project, group=self.cfg.wandb_group, dir=self.dir, config=config_dict,
                       reinit="finish_previous", **({"id": resume_id, "resume": "allow"} if resume_id else {}))
        try:
            run = wandb.init(mode=mode, **options)
        except Exception as e:  # wandb's errors (CommError, AuthenticationError, timeouts) have no common base
            if mode != "online":
                raise
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"warning: wandb could not start online ({type(e).__name__}: {why}); logging offline to "
                  f"{os.path.join(self.dir, 'wandb')} instead (upload it later with `wandb sync`)",
                  file=sys.stderr, flush=True)
            run = wandb.init(mode="offline", **options)
        run.define_metric("rollout/step")
        run.define_metric("*", step_metric="rollout/step")
        return run

    def log(self, step, metrics):
        row = dict(metrics, **{"rollout/step": step})
        self.history.append(row)
        self.next_step = step + 1
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb and step > self.wandb_through:
            self.wandb.log(row)

    def finish(self):
        if self.history:
            self._plot()
            print(self.summary())
        self.close()

    def close(self, exit_code=None):
        """Finish the wandb run (its closing lines print now; exit_code 1 marks it failed); idempotent."""
        if self.wandb:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None

    def _plot(self):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["rollout/step"] for r in self.history]
        keys = ("rollout/reward", "rollout/spec_accept_length")
        keys += ("eval/reward", "eval/spec_accept_length") if any("eval/reward" in r for r in self.history) else ()
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
        for ax, key in zip(axes, keys):
            points = [(s, r[key]) for s, r in zip(steps, self.history) if key in r]  # eval: every N steps
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
            ax.set_xlabel("step")
            ax.set_title(key)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(self.dir, "reward_and_accept_length.png"), dpi=100)
        plt.close(fig)

    def summary(self):
        lines = [f"{'metric':<30} {'first step':>12} {'last step':>12}"]
        for key in SUMMARY_KEYS:
            rows = [r for r in self.history if key in r]  # eval/* rows are every --eval-interval steps
            if rows and key in self.history[-1] or key.startswith("eval/") and rows:
                lines.append(f"{key:<30} {rows[0][key]:>12.4f} {rows[-1][key]:>12.4f}")
        return "\n".join(lines)
