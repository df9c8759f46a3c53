#!/usr/bin/env python
"""Draft ceiling: how far an MTP draft is from what this policy allows, and what more training buys.

    python scripts/bench/draft_ceiling.py --hf-checkpoint runs/ceiling_rl/hf   # an RL-trained policy
    python scripts/bench/draft_ceiling.py --hf-checkpoint checkpoints/tiny-qwen2 --oracle-only --k 7
                                        # any target, MTP or not: the oracle row alone (an external or block
                                        # draft's ceiling)

Every figure is an expectation over contexts of the policy's own samples (eval prompts, the
rollout temperature), for k argmax drafts verified the way the engine verifies them (strict:
draft i survives with probability a_i = p(d_i | context, d_1..d_{i-1}) at that temperature):
tokens per verify E = 1 + a_1 + a_1 a_2 + ..., and the unconditional acceptance at draft
position i, E[a_1 ... a_i] (what `rollout/spec_accept_rate_pos_i` counts). Drafters:

  oracle          d_i = the policy's own argmax: the best any argmax drafter can do here
  checkpoint      the checkpoint's MTP layers, drafting exactly as the engine does
                  (DeepSeek chaining over the layers, then the last layer reused one
                  position further on its own output: rollout/embedded/proposers/mtp.py)
  offline ce      those layers trained on (many more) policy samples, trunk frozen, with
                  megatron-core's depth-1 loss, `--train-steps` Adam steps
  offline ce + exact reuse
                  the same, plus the loss of every reused depth 2..k computed exactly as
                  the drafter runs it (the query one position further, attending over the
                  depth-1 entries before it: EAGLE-3's training-time test)

The offline rows answer whether the online draft is limited by its training (40 RL steps),
by the loss it is trained with, or by the capacity of the layer itself. Contexts are every
prefix from the end of the prompt to the last token but one; the engine visits a subset of
them (it jumps over accepted drafts), so its measured figures differ slightly.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mtp.loss import mtp_loss  # noqa: E402
from mtp.sampling import logprobs_at_temperature  # noqa: E402
from rollout.data import read_prompt_file  # noqa: E402
from rollout.embedded.engine import Engine, EngineConfig  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from vime.errors import UserError, require  # noqa: E402
from vime.sample import Sample  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True,
                   help="policy with MTP layers, any policy with --oracle-only (HF dir with eval.jsonl/train.jsonl)")
    p.add_argument("--oracle-only", action="store_true",
                   help="only the oracle row: no MTP layer needed, nothing trained")
    p.add_argument("--k", type=int, default=3, help="drafts per verify")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--eval-samples", type=int, default=4, help="samples per eval prompt")
    p.add_argument("--eval-contexts", type=int, default=4000, help="contexts drawn from the eval samples")
    p.add_argument("--train-prompts", type=int, default=4096, help="train prompts sampled once each for offline training")
    p.add_argument("--train-steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64, help="sequences per offline step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    return p.parse_args()


# ------------------------------------------------------------------ policy samples
def policy_samples(engine, path, n, temperature, max_new_tokens, seed, limit=None):
    """[(token ids, prompt length)] of n samples per prompt of a prompt file, plain decoding."""
    rows = read_prompt_file(path, "prompt", "label", engine.codec)[:limit]
    bos = engine.cfg.bos_token_id
    samples = [Sample(prompt_ids=engine.codec.encode_prompt(p, bos), index=i, sample_index=j)
               for i, (p, _) in enumerate(rows) for j in range(n)]
    engine.generate(samples, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed))
    return [(s.tokens, len(s.prompt_ids)) for s in samples]


def contexts_by_length(seqs, limit, seed, spare=0):
    """{n: [B, n + spare] tokens}: up to `limit` prefixes drawn uniformly from every prefix of
    n >= 2 tokens from the prompt's end on, with `spare` true tokens after it (prefixes
    without them are left out)."""
    every = [(i, n) for i, (tokens, prompt_len) in enumerate(seqs)
             for n in range(max(prompt_len, 2), len(tokens) - spare)]
    picks = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed))[:limit].tolist()
    groups = {}
    for i, n in sorted(every[j] for j in picks):
        groups.setdefault(n, []).append(seqs[i][0][:n + spare])
    return {n: torch.tensor(rows) for n, rows in sorted(groups.items())}


# ------------------------------------------------------------------ drafting as the engine does it
def positions_of(length, batch):
    return torch.arange(length).expand(batch, length)


def mtp_states(model, tokens):
    """The states the first MTP layer reads, trunk frozen."""
    with torch.no_grad():
        return model.forward_states(tokens, positions_of(tokens.shape[1], tokens.shape[0]))[1]


def draft_chain(model, prefix, k, teacher=None, detach_carry=False, states=None):
    """Draft logits [B, k, V] at the context prefix [B, n] (n >= 2).

    Layer j (0-based) at position t reads the previous layer's output at t and token t+j+1;
    past the last layer, that layer is reused one position further on its own output and the
    previous draft, attending over its entries before it (rollout/embedded/proposers/mtp.py). Drafts
    are each depth's argmax or, with `teacher` [B, k-1], the true next tokens. `states`: the
    trunk's MTP-input states of the prefix when already known. Every call recomputes the
    whole prefix: with causal attention that equals the engine's cache."""
    b, n = prefix.shape
    layers, ext, logits = model.num_mtp_layers, prefix, []
    layer_input = (mtp_states(model, prefix) if states is None else states)[:, :n - 1]  # what layer j reads at 0..n-2
    tails = None  # the reused layer's own outputs, fed back one position further
    for depth in range(k):
        j = min(depth, layers - 1)
        reused = depth - j
        hidden = layer_input if tails is None else torch.cat([layer_input, tails], 1)
        out = model.mtp_forward(j, ext[:, j + 1:j + n + reused], hidden, positions_of(n - 1 + reused, b))
        logits.append(model.logits(out[:, -1]))
        if depth + 1 == k:
            break
        nxt = teacher[:, depth:depth + 1] if teacher is not None else logits[-1].argmax(-1, keepdim=True)
        ext = torch.cat([ext, nxt], 1)
        if depth + 1 < layers:
            layer_input = out  # the next layer reads this one's outputs at 0..n-2
        else:
            last = out[:, -1:].detach() if detach_carry else out[:, -1:]
            tails = last if tails is None else torch.cat([tails, last], 1)
    return torch.stack(logits, 1)


def chain_acceptance(model, prefix, drafts, temperature):
    """a_i = p(d_i | prefix, d_<i) [B, k] from one trunk forward over prefix + drafts."""
    n, k = prefix.shape[1], drafts.shape[1]
    full = torch.cat([prefix, drafts], 1)
    with torch.no_grad():
        logp = logprobs_at_temperature(model.logits(model(full, positions_of(full.shape[1], full.shape[0]))), temperature)
    return logp[:, n - 1:n - 1 + k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1).exp()


def oracle_drafts(model, prefix, k):
    """The policy's own greedy continuation of k tokens."""
    ext = prefix
    with torch.no_grad():
        for _ in range(k):
            nxt = model.logits(model(ext, positions_of(ext.shape[1], ext.shape[0]))[:, -1]).argmax(-1, keepdim=True)
            ext = torch.cat([ext, nxt], 1)
    return ext[:, prefix.shape[1]:]


def mtp_drafts(model, prefix, k):
    with torch.no_grad():
        return draft_chain(model, prefix, k).argmax(-1)


def evaluate(model, groups, k, temperature, drafter):
    """{"tokens_per_verify": E, "acc": [unconditional acceptance per position]} over all contexts."""
    total, count = torch.zeros(k), 0
    for prefix in groups.values():
        a = chain_acceptance(model, prefix, drafter(model, prefix, k), temperature)
        total += a.cumprod(1).sum(0)
        count += prefix.shape[0]
    acc = (total / count).tolist()
    return {"tokens_per_verify": 1 + sum(acc), "acc": acc}


# ------------------------------------------------------------------ offline training of the MTP layers
def mtp_parameters(model):
    return [p for j in range(model.num_mtp_layers) for p in model.mtp_layer(j).parameters()]


def depth1_loss(model, batch, loss_mask):
    """Megatron-core's depth-1 MTP loss on whole sequences (position t reads token t+1, predicts t+2)."""
    b, s = batch.shape
    hidden = mtp_states(model, batch)[:, :s - 1]
    out = model.mtp_forward(0, batch[:, 1:], hidden, positions_of(s - 1, b))
    return mtp_loss(model.logits(out), batch, loss_mask, depth=1)


def contexts_with_future(seqs, k):
    """({n: [indices of sequences with a context of n tokens and k true tokens after it]},
    weights proportional to how many there are), for drawing contexts uniformly."""
    eligible = {}
    for i, (tokens, prompt_len) in enumerate(seqs):
        for n in range(max(prompt_len, 2), len(tokens) - k + 1):
            eligible.setdefault(n, []).append(i)
    lengths = sorted(eligible)
    return lengths, eligible, torch.tensor([len(eligible[n]) for n in lengths], dtype=torch.float)


def reuse_loss(model, seqs, states, contexts, k, rng, rows, detach_carry, lengths_per_step=4):
    """Cross-entropy of depths 2..k as the drafter runs them, teacher-forced, on `rows`
    contexts drawn uniformly, at `lengths_per_step` lengths (one exact forward per length)."""
    lengths, eligible, weights = contexts
    total, count = 0.0, 0
    for pick in torch.multinomial(weights, lengths_per_step, replacement=True, generator=rng).tolist():
        n, pool = lengths[pick], eligible[lengths[pick]]
        idx = [pool[j] for j in torch.randint(len(pool), (rows // lengths_per_step,), generator=rng).tolist()]
        take = torch.tensor([seqs[i][0][:n + k] for i in idx])
        prefix, future = take[:, :n], take[:, n:]
        logits = draft_chain(model, prefix, k, teacher=future[:, :k - 1], detach_carry=detach_carry,
                             states=torch.stack([states[i][:n] for i in idx]))
        total = total + torch.nn.functional.cross_entropy(logits[:, 1:].flatten(0, 1), future[:, 1:k].flatten(),
                                                          reduction="sum")
        count += take.shape[0] * (k - 1)
    return total / count


def padded(seqs, pad_id):
    """[B, S] tokens and the response loss mask of sequences of different lengths."""
    s = max(len(t) for t, _ in seqs)
    tokens = torch.full((len(seqs), s), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), s)
    for i, (t, p) in enumerate(seqs):
        tokens[i, :len(t)] = torch.tensor(t)
        mask[i, p:len(t)] = 1.0
    return tokens, mask


def train_offline(model, seqs, args, exact_reuse, detach_carry=False):
    """Adam on the MTP layers only; returns the last 20 steps' mean losses (depth 1, reused depths)."""
    torch.manual_seed(args.seed)
    rng = torch.Generator().manual_seed(args.seed)
    params = mtp_parameters(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=args.lr)
    if exact_reuse:  # the trunk is frozen: its states are computed once
        states = [mtp_states(model, torch.tensor([t]))[0] for t, _ in seqs]
        contexts = contexts_with_future(seqs, args.k)
    history = []
    for step in range(args.train_steps):
        idx = torch.randint(len(seqs), (args.batch,), generator=rng).tolist()
        tokens, mask = padded([seqs[i] for i in idx], model.cfg.pad_token_id or 0)
        loss = depth1_loss(model, tokens, mask)
        extra = reuse_loss(model, seqs, states, contexts, args.k, rng, args.batch, detach_carry) if exact_reuse else torch.zeros(())
        opt.zero_grad()
        (loss + extra).backward()
        opt.step()
        history.append((loss.item(), extra.item()))
    for p in params:
        p.requires_grad_(False)
    tail = history[-20:]
    return [sum(h[i] for h in tail) / len(tail) for i in range(2)]


# name -> train_offline options
OFFLINE_VARIANTS = {
    "offline ce": dict(exact_reuse=False),
    "offline ce + exact reuse": dict(exact_reuse=True),
    # the reused depths' loss does not reach the depth-1 output it is fed (the chain detached)
    "offline ce + exact reuse, carry detached": dict(exact_reuse=True, detach_carry=True),
}


# ------------------------------------------------------------------ report
def row(name, result):
    acc = " / ".join(f"{a:.3f}" for a in result["acc"])
    cond = [result["acc"][0]] + [result["acc"][i] / max(result["acc"][i - 1], 1e-9) for i in range(1, len(result["acc"]))]
    return f"| {name} | {result['tokens_per_verify']:.3f} | {acc} | {' / '.join(f'{c:.2f}' for c in cond)} |"


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    try:
        require(args.k >= 1, f"--k must be >= 1 (got {args.k})")
        require(os.path.isdir(args.hf_checkpoint), f"--hf-checkpoint {args.hf_checkpoint}: no such directory")
        engine = Engine.from_checkpoint(args.hf_checkpoint, EngineConfig(max_batch_size=256))
        require(args.oracle_only or engine.model.num_mtp_layers >= 1,
                f"--hf-checkpoint {args.hf_checkpoint}: the checkpoint has no MTP layer; give --oracle-only for the oracle row alone")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    model = engine.model
    start = time.time()
    eval_seqs = policy_samples(engine, os.path.join(args.hf_checkpoint, "eval.jsonl"), args.eval_samples,
                               args.temperature, args.max_new_tokens, args.seed + 1)
    train_seqs = [] if args.oracle_only else policy_samples(
        engine, os.path.join(args.hf_checkpoint, "train.jsonl"), 1, args.temperature, args.max_new_tokens,
        args.seed, args.train_prompts)
    groups = contexts_by_length(eval_seqs, args.eval_contexts, args.seed)
    print(f"[ceiling] {len(eval_seqs)} eval samples ({sum(len(g) for g in groups.values())} contexts), "
          f"{len(train_seqs)} train samples, k = {args.k}, T = {args.temperature}", flush=True)
    results = {"oracle": evaluate(model, groups, args.k, args.temperature, oracle_drafts)}
    if not args.oracle_only:
        results["checkpoint"] = evaluate(model, groups, args.k, args.temperature, mtp_drafts)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    for name, variant in ({} if args.oracle_only else OFFLINE_VARIANTS).items():
        model.load_state_dict(initial)
        losses = train_offline(model, train_seqs, args, **variant)
        results[name] = {**evaluate(model, groups, args.k, args.temperature, mtp_drafts), "final_losses": losses}
        print(f"[ceiling] {name}: {args.train_steps} steps, final loss depth 1 {losses[0]:.3f}, "
              f"reuse depths {losses[1]:.3f} ({time.time() - start:.0f} s)", flush=True)
    print(f"\n| drafter (k = {args.k}) | tokens / verify | acceptance @1..{args.k} | conditional |")
    print("|---|---|---|---|")
    for name, result in results.items():
        print(row(name, result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
