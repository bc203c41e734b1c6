"""The switches a real run combines, run together on 2 gloo ranks: a covering set of runs over parallel mode ×
micro-batching × mismatch correction × precision × gradient checkpointing × how unequal the ranks' trajectory lengths
are (every pair of values appears in some run), each run's step gradient compared with one process's on the same
trajectories. The gradient of one optimiser mini-batch does not depend on how it is cut into micro-batches and ranks
(the loss divides by its global token count, D18), so every combination must give one process's gradient."""
import contextlib
import dataclasses
import datetime
import itertools
import math
import os

import torch

import rollout
import train
from harness import config
from harness.run import policy as policy_mod
from tests.conftest import free_port, hand_made_trajectories
from tests.test_train import peaked_tiny_model

FACTORS = (("parallel", ("ddp", "fsdp")), ("micro_batches", ("fixed", "token budget")),
           ("correction", ("off", "TIS + token mask")), ("precision", ("float32", "bfloat16")),
           ("checkpointing", ("off", "on")), ("lengths", ("equal", "unequal")))
# A strength-2 covering array of six two-level factors in six runs: factor f is at its second value in the runs of
# SUBSETS[f], distinct 3-subsets of runs 1..5 (two such subsets share one or two runs and each has one the other
# lacks; run 0 has every factor at its first value), so every pair of values of every two factors meets in some run.
SUBSETS = ((1, 2, 3), (1, 4, 5), (2, 4, 5), (3, 4, 5), (1, 2, 4), (2, 3, 5))
RUNS = [{name: values[run in SUBSETS[f]] for f, (name, values) in enumerate(FACTORS)} for run in range(6)]


def pairs_covered(runs) -> tuple[int, int]:
    """(pairs of values of two factors that some run has, all such pairs)."""
    seen = {(a, run[a], b, run[b]) for run in runs for a, b in itertools.combinations(run, 2)}
    total = sum(len(va) * len(vb) for (_, va), (_, vb) in itertools.combinations(FACTORS, 2))
    return len(seen), total


def test_the_runs_cover_every_pair():
    assert pairs_covered(RUNS) == (60, 60)
    assert pairs_covered(RUNS[:5])[0] < 60                     # fewer runs would leave pairs out


def trajectories_of(lengths: str):
    """4 questions × k = 2 (ranks 0 and 1 take two questions each). unequal: rank 0's responses are 60-90 tokens,
    rank 1's 4-8, so a token budget packs rank 0's one per micro-batch and rank 1's together."""
    if lengths == "equal":
        return hand_made_trajectories()
    g = torch.Generator().manual_seed(5)
    out = []
    for q in range(4):
        prompt = torch.randint(100, 5000, (5,), generator=g).tolist()
        for j in range(2):
            n = int(torch.randint(60, 90, (1,), generator=g)) if q < 2 else int(torch.randint(4, 8, (1,), generator=g))
            mask = [1] * n
            mask[n // 3:n // 3 + 2] = [0, 0]
            out.append(rollout.Trajectory(q, j, prompt, torch.randint(100, 5000, (n,), generator=g).tolist(), mask))
    return out, torch.rand(len(out), generator=g)


def with_generator_logprobs(trajectories, lm):
    """Each trajectory's gen_logp: the model's own log-probs moved by 0.9·sin(token id), so that ρ = π_old/π_gen
    leaves [1/2, 2] at some tokens (the token mask drops them) and the truncated weight caps others."""
    policy = policy_mod.Policy(lm)
    batch = policy_mod.tensorize([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajectories], 0, "cpu")
    with torch.no_grad():
        logp, _ = policy(batch.input_ids, batch.attention_mask, torch.ones_like(batch.mask))
    for i, t in enumerate(trajectories):
        start = len(t.prompt_ids) - 1
        row = logp[i, start:start + len(t.response_ids)] + 0.9 * torch.sin(torch.tensor(t.response_ids).float())
        t.gen_logp = [v if m else 0.0 for v, m in zip(row.tolist(), t.loss_mask)]
    return trajectories


def run_config(run) -> config.Config:
    return config.Config(parallel=run["parallel"], micro_batch_size=3, bf16=run["precision"] == "bfloat16",
                         max_tokens_per_micro_batch=40 if run["micro_batches"] == "token budget" else 0,
                         tis_cap=2.0 if run["correction"] != "off" else 0.0,
                         mismatch_masks=["token"] if run["correction"] != "off" else [])


def step_gradient(policy, trajectories, rewards, cfg, world) -> tuple[dict, list[int]]:
    """One optimiser mini-batch as rl_step runs it (advantages, micro-batches, the old-policy pass in eval mode, the
    update in train mode, both under the run's precision), with the old log-probs moved by 0.4·sin(token id) so that
    ratios leave 1 and clipping happens. Returns the full gradients and this rank's micro-batch sizes."""
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if cfg.bf16 else contextlib.nullcontext
    adv = train.outcome_advantages(trajectories, rewards, cfg, 0)
    batches = train.micro_batches(trajectories, adv, rewards, 1, cfg, 0, "cpu")
    train.old_policy_pass(policy, None, batches, cfg, amp)
    for mb in batches[0]:
        mb.old_logp = mb.old_logp + 0.4 * torch.sin(mb.input_ids[:, 1:].float()) * mb.mask
    policy_mod.unwrap(policy).lm.train()
    train.accumulate_gradients(policy, batches[0], cfg, world, amp, "test")
    grads = {}
    for name, p in policy_mod.unwrap(policy).named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.")] = grad.detach().clone()
    return grads, [len(mb.mask) for mb in batches[0]]


def make_policy(tokenizer, run, world):
    lm = peaked_tiny_model(tokenizer)
    if run["checkpointing"] == "on":
        policy_mod.enable_gradient_checkpointing(lm)
    policy = policy_mod.Policy(lm)
    if world == 1:
        return policy
    if run["parallel"] == "fsdp":
        return policy_mod.shard(policy, bf16=run["precision"] == "bfloat16")
    return torch.nn.parallel.DistributedDataParallel(policy)


def _worker(rank, world, port, tok_dir, data, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))   # a hang fails
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        inputs = torch.load(data, weights_only=False)
        results = []
        for run in RUNS:
            trajectories, rewards = inputs[run["lengths"]]
            mine = slice(rank * len(trajectories) // world, (rank + 1) * len(trajectories) // world)
            cfg = run_config(run)
            grads, sizes = step_gradient(make_policy(tokenizer, run, world), trajectories[mine], rewards[mine], cfg,
                                         world)
            natural = len(train.split_micro_batches(
                list(range(len(trajectories[mine]))), [len(t.prompt_ids) + len(t.response_ids)
                                                       for t in trajectories[mine]], cfg.micro_batch_size,
                cfg.max_tokens_per_micro_batch))
            results.append({"grads": grads, "sizes": sizes, "natural": natural})
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, [{k: r[k] for k in ("sizes", "natural")} for r in results])
        if rank == 0:
            torch.save({"results": results, "ranks": gathered}, out)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def relative_difference(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all parameters' gradients together."""
    diff = math.sqrt(sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b))
    return diff / math.sqrt(sum(float(b[n].double().pow(2).sum()) for n in b))


def test_every_combination_gives_one_process_gradient(tokenizer, tmp_path):
    """Six 2-rank runs covering every pair of the six settings: each run's gradient is one process's on the same
    trajectories and settings (float32 within 1e-5 relative, bfloat16 within 2e-2: the two sides round differently);
    in the unequal runs with a token budget the ranks' own packing differs, and both still run as many micro-batches.
    Prints the table."""
    import torch.multiprocessing as mp
    tok_dir, data, out = tmp_path / "tok", tmp_path / "data.pt", tmp_path / "grads.pt"
    tokenizer.save_pretrained(tok_dir)
    inputs = {}
    for lengths in ("equal", "unequal"):
        trajectories, rewards = trajectories_of(lengths)
        inputs[lengths] = (with_generator_logprobs(trajectories, peaked_tiny_model(tokenizer)), rewards)
    torch.save(inputs, data)
    mp.start_processes(_worker, args=(2, free_port(), str(tok_dir), str(data), str(out)), nprocs=2,
                       start_method="spawn")
    saved = torch.load(out, weights_only=False)
    rows, worst = [], {}
    for i, run in enumerate(RUNS):
        trajectories, rewards = inputs[run["lengths"]]
        one, _ = step_gradient(make_policy(tokenizer, run, 1), trajectories, rewards,
                               dataclasses.replace(run_config(run), micro_batch_size=len(trajectories),
                                                   max_tokens_per_micro_batch=0), 1)
        two = saved["results"][i]["grads"]
        assert set(two) == set(one)
        assert all(torch.isfinite(g).all() for g in two.values())
        diff = relative_difference(two, one)
        ranks = [r[i] for r in saved["ranks"]]
        rows.append((i, run, diff, [r["natural"] for r in ranks], [len(r["sizes"]) for r in ranks]))
        bound = 2e-2 if run["precision"] == "bfloat16" else 1e-5
        worst[run["precision"]] = max(worst.get(run["precision"], 0.0), diff)
        assert diff < bound, (run, diff)
        assert len(ranks[0]["sizes"]) == len(ranks[1]["sizes"])                 # as many passes on each rank
        assert sum(ranks[0]["sizes"]) == sum(ranks[1]["sizes"]) == len(trajectories) // 2
    budget_unequal = [r for r in rows if r[1]["micro_batches"] == "token budget" and r[1]["lengths"] == "unequal"]
    assert budget_unequal and all(r[3][0] != r[3][1] for r in budget_unequal)    # the case that used to hang
    assert any(r[1]["parallel"] == "fsdp" and r[3][0] != r[3][1] for r in rows)     # ... and hung under FSDP2
    names = [name for name, _ in FACTORS]
    print("\nrun | " + " | ".join(names) + " | micro-batches per rank (own → run) | ‖g₂ − g₁‖/‖g₁‖")
    for i, run, diff, natural, used in rows:
        print(f"{i} | " + " | ".join(str(run[n]) for n in names) + f" | {natural} → {used} | {diff:.2e}")
    covered, total = pairs_covered(RUNS)
    print(f"{len(RUNS)} runs, {covered} of {total} pairs covered; largest difference: " +
          ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
