"""How a step's samples are grouped: GRPO groups (the n samples of one prompt), spread over the
rollout engines by load with each group on one engine (its prompt is prefilled once), and DAPO's
dynamic sampling (groups whose rewards are all equal carry no GRPO signal: keep the others).

Pure functions over `Sample` lists; the rollout manager (rollout/ray_workers.py) draws and calls them.
"""
import heapq


def groups_of(samples):
    """[[samples of one prompt], ...] in prompt order (grouped by `Sample.index`)."""
    by_index = {}
    for s in samples:
        by_index.setdefault(s.index, []).append(s)
    return [sorted(by_index[i], key=lambda s: s.sample_index) for i in sorted(by_index)]


def group_load(group, max_new_tokens):
    """Tokens a group can cost an engine: each sample's prompt plus its response budget."""
    return sum(len(s.prompt_ids) + max_new_tokens for s in group)


def spread_groups(groups, num_engines, max_new_tokens):
    """Per engine, the samples it generates: whole groups, heaviest first onto the least-loaded
    engine (longest-processing-time first), so the engines finish about together."""
    shards = [[] for _ in range(num_engines)]
    heap = [(0, e) for e in range(num_engines)]
    order = sorted(range(len(groups)), key=lambda g: -group_load(groups[g], max_new_tokens))
    for g in order:
        load, engine = heapq.heappop(heap)
        shards[engine].extend(groups[g])
        heapq.heappush(heap, (load + group_load(groups[g], max_new_tokens), engine))
    return shards


def has_signal(group):
    """A group whose rewards are not all equal: its group-normalised advantages are not all zero."""
    return len({s.reward for s in group}) > 1


class DynamicBatch:
    """Collects groups draw after draw until `target` informative ones are kept (DAPO).

    `full()` says when to stop drawing; `batch()` gives exactly `target` groups: the informative
    ones first and, when the draws ran out (the bound), zero-signal groups to fill the rest — they
    add no policy gradient, and the batch keeps the size the trainer's steps are cut for."""

    def __init__(self, target):
        self.target = target
        self.kept, self.zero_signal, self.drawn = [], [], 0

    def add(self, groups):
        for g in groups:
            self.drawn += 1
            (self.kept if has_signal(g) else self.zero_signal).append(g)

    def full(self):
        return len(self.kept) >= self.target

    def batch(self):
        """(groups of the batch, how many of them are zero-signal fillers)."""
        missing = max(0, self.target - len(self.kept))
        return self.kept[:self.target] + self.zero_signal[:missing], missing

    def kept_fraction(self):
        """Informative groups over groups drawn (the share dynamic sampling keeps)."""
        return len(self.kept) / max(self.drawn, 1)


def renumber(groups):
    """The groups' samples, flat, with `index` = the group's position in this batch."""
    out = []
    for i, group in enumerate(groups):
        for s in group:
            s.index = i
            out.append(s)
    return out


def zero_signal_share(groups):
    """Share of groups without GRPO signal (all rewards equal)."""
    return sum(not has_signal(g) for g in groups) / max(len(groups), 1)


def check_dynamic_sampling(rollout_cfg):
    """One-line errors for dynamic-sampling settings that cannot work, before any actor starts.
    The bound must be able to fill a batch even if every group drawn had signal."""
    from vime.errors import require

    r = rollout_cfg
    require(r.over_sampling_batch_size is None or r.dynamic_sampling,
            "--over-sampling-batch-size sets the draws of dynamic sampling: add --dynamic-sampling or drop it")
    if not r.dynamic_sampling:
        return
    per_draw = r.over_sampling_batch_size or r.rollout_batch_size
    # the flags' own ranges are in vime.config.RANGES, checked before this
    require(r.n_samples_per_prompt >= 2, f"--dynamic-sampling keeps groups whose rewards differ: it needs "
            f"--n-samples-per-prompt >= 2 (got {r.n_samples_per_prompt})")
    require(per_draw * r.dynamic_sampling_max_draws >= r.rollout_batch_size,
            f"--dynamic-sampling-max-draws {r.dynamic_sampling_max_draws} x --over-sampling-batch-size {per_draw} "
            f"= {per_draw * r.dynamic_sampling_max_draws} prompts can never fill --rollout-batch-size "
            f"{r.rollout_batch_size}; raise --dynamic-sampling-max-draws or --over-sampling-batch-size")
