"""AEPO training, end to end: tree rollouts with tools -> rewards -> entropy-aware advantages -> entropy-balanced
clipped policy loss, on 1..N processes; the paper's baselines are switches of the same loop.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3 (the whole training
algorithm; algorithm.md §2-§7). Each step samples k trajectories per question with the dynamic entropy-balanced tree
rollout (rollout.py), scores them with the deep-research reward (reward.py), turns rewards into group advantages
reweighted by the old policy's token entropy (advantage.py), and takes several clipped optimiser steps on
mini-batches of the same rollouts (loss.py).

    python train.py                                    # embedded default: SmolLM2-135M + offline Wikipedia, CPU
    torchrun --nproc_per_node=8 train.py --config configs/aepo_qwen3_14b.yaml --parallel fsdp --backend vllm
    python train.py --help                             # every flag, with its meaning (README: every command)

One code path for 1..N processes: each rank rolls out its own share of the step's questions (all k trajectories of a
question stay on one rank), and the only cross-rank quantities are sums: the token and sequence counts of each
optimiser mini-batch (the loss divides by them), the batch entropy statistics (the entropy-aware advantage z-scores
with them), gradients and logged metrics. The set-up is harness/run/startup.py, the machinery the rest of harness/.

Deviations from the paper / official code (algorithm.md §8): D16 (old-policy entropy z-scored over the batch on all
ranks), D18 (the loss divided by the mini-batch's global token count), D40 (optional supervised cold start), D41
(torchrun processes; under FSDP2 the transformers backend generates with an unsharded copy of the policy).
"""
from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import torch

import advantage
import eval as evaluation
import loss
import reward
import rollout
from harness import cli, config, generation, memory, mismatch, settings, trees
from harness.run import checkpoint, parallel, probe, rundir, runlog
from harness.run.policy import located, micro_batches, no_grad_sync, optimizer_step, pad_share, tensorize, unwrap
from harness.run.startup import Run, set_up

# ---------------------------------------------------------------------------------------------------------------------
# One training step (this rank's questions; every rank runs it, the collectives are sums)


def rl_step(run: Run, step: int, progress=None) -> tuple[dict, runlog.StepBatch]:
    """Step `step` (0-based): rollout -> reward -> advantages -> old-policy pass -> update -> weights to the
    generator. Returns the step's metrics (means over all ranks) and what this rank rolled out (for the logs)."""
    cfg, clock = run.cfg, runlog.Clock()
    # ---- rollout (algorithm.md §2): k trajectories per question of this rank's share, tree-structured
    rows = run.step_questions(step)
    with clock("rollout"), torch.no_grad(), run.amp():
        trajectories, tree_stats = rollout.tree_rollout(
            [run.tools.format.build_prompt(run.tokenizer, r["question"]) for r in rows], run.generator, run.tools,
            run.tokenizer, run.tree_settings, sampling=run.sampling, seed=run.rollout_seed(step), progress=progress)
        run.generator.sleep()                    # its memory to the update, where it has any to give (vLLM, GPU)
    rollout_seconds = parallel.gather(clock.seconds["rollout"])   # the slowest rank holds the others here

    # ---- reward (algorithm.md §5), once per trajectory; DAPO keeps the groups whose rewards differ (§7)
    scores = [run.score(t.text, rows[t.group_id]["golds"]) for t in trajectories]
    rewards = rewards_of(scores, trajectories, cfg)
    if cfg.dynamic_sampling:
        rows, trajectories, scores, rewards, tree_stats = keep_varied_groups(rows, trajectories, scores, rewards,
                                                                             tree_stats, run.questions_here)

    with clock("old_logp"):
        # ---- outcome advantage A per token (§3a; GiGPO's step advantage, §7), mini-batches of whole questions
        adv = outcome_advantages(trajectories, rewards, cfg, run.tokenizer.pad_token_id)
        batches = micro_batches(trajectories, adv, rewards, cfg.questions_per_step // cfg.mini_batch_size, cfg,
                                run.tokenizer.pad_token_id, run.device, run.packed)
        # ---- old-policy log-probs and token entropies (one no-grad pass), entropy-aware advantage Ã (§3b)
        olds, entropy_sums, mismatch_sums = old_policy_pass(run.policy, run.ref, batches, cfg, run.amp,
                                                            run.correction)

    # ---- policy update (algorithm.md §4): ppo_epochs × mini-batches, each one optimiser step
    with clock("update"):
        losses, grad_norms = Counter(), []
        unwrap(run.policy).lm.train()
        for epoch in range(cfg.ppo_epochs):
            for j, mbs in enumerate(batches):
                losses.update(accumulate_gradients(run.policy, mbs, olds[j], cfg, run.world, run.amp,
                                                   f"step {step + 1}, epoch {epoch}, mini-batch {j}", run.objective,
                                                   run.correction))
                grad_norms.append(optimizer_step(run.policy, run.optimizer, cfg.grad_clip))
        unwrap(run.policy).lm.eval()

    # ---- the new weights to the generator (a collective under FSDP2)
    with clock("sync"):
        run.generator.update_weights(run.generator_weights())

    batch = runlog.StepBatch(rows, trajectories, scores, rewards, tree_stats["m_per_question"])
    metrics = runlog.step_metrics(step + 1, batch, tree_stats, adv, entropy_sums, losses, grad_norms)
    metrics.update(mismatch.mismatch_metrics(mismatch_sums, run.correction), lr=cfg.lr,
                   pad_share=pad_share(batches, run.packed))
    metrics.update(clock.metrics(rollout_seconds, metrics["n_valid_tokens"] * cfg.ppo_epochs))
    return metrics, batch


# ---------------------------------------------------------------------------------------------------------------------
# The training loop: set-up, then per step the step, its log, an evaluation and a checkpoint when due


def train(cfg, rank: int, world: int, device: torch.device, state: rundir.RunState | None = None, *,
          score=reward.score_response, make_generator=generation.make_generator) -> dict:
    """The whole run on this rank (every rank calls it). score(text, golds) -> reward.score_response's dict and
    make_generator (generation.make_generator's arguments) are what a test may replace."""
    from tqdm import tqdm
    state = state or rundir.RunState()
    run = set_up(cfg, rank, world, device, state, score, make_generator)
    trackers, watch = runlog.Trackers(run.cfg, run.dir, run.master), runlog.MismatchWatch()
    evals = {}
    before = evaluate(run, "before") if run.start_step == 0 and cfg.eval_before else runlog.saved_eval(run.dir,
                                                                                                        "before")
    if before:
        evals["before"] = before["pass@1"]
    probe_set = probe.record(run)                # a fixed set of trajectories, for the policy's own entropy
    bar = tqdm(total=run.steps, initial=run.start_step, desc="train", unit="step", disable=not run.master,
               dynamic_ncols=True)
    metrics = {}
    for step in range(run.start_step, run.steps):
        metrics, batch = rl_step(run, step, runlog.RolloutProgress(bar) if run.master else None)
        if probe_set:
            metrics["probe_entropy"] = probe.entropy(run, probe_set)
        step_trees = parallel.gather(trees.records(step + 1, batch.rows, batch.trajectories, batch.m_per_question,
                                                   batch.rewards))
        state.steps_done = step + 1
        if run.master:
            runlog.log_step(run.dir, metrics, batch, run.steps, run.cfg.log_samples, run.search, run.log)
            if warning := watch.check(step + 1, metrics):
                run.log(warning)
            trees.append(run.dir / "trees.jsonl", [rec for recs in step_trees for rec in recs])
            trackers.log(metrics, step + 1)
            bar.set_postfix_str("")
            bar.update(1)
        if run.cfg.eval_every and (step + 1) % run.cfg.eval_every == 0 and step + 1 < run.steps:
            evaluate(run, f"step{step + 1}")
        if (run.cfg.save_every and (step + 1) % run.cfg.save_every == 0) or step + 1 == run.steps:
            checkpoint.save(run.dir, step + 1, run.policy, run.optimizer, run.tokenizer, rank=rank,
                            keep=run.cfg.keep_checkpoints, config_yaml=rundir.config_yaml(run.cfg), info=run.info,
                            export_dtype=torch.bfloat16 if run.cfg.bf16 else torch.float32,
                            trainer_state=run.cfg.save_trainer_state)
    bar.close()
    after = parallel.on_rank0(lambda: runlog.saved_eval(run.dir, "after")) if run.start_step == run.steps else None
    if after is None:                            # (a run killed during its final evaluation has none: it runs now)
        after = evaluate(run, "after")
    if after:
        evals["after"] = after["pass@1"]
    if run.master and (run.dir / "metrics.jsonl").exists():
        runlog.plot_curves(run.dir / "metrics.jsonl", run.dir / "curves.png", evals)
        trees.draw(trees.load(run.dir / "trees.jsonl"), run.dir / "trees.png", f"{run.dir.name}: the last step's trees")
        run.log(f"run directory: {run.dir}")
    trackers.close()
    return {"run_dir": str(run.dir), "last": metrics, "evals": evals, "steps": run.steps}


def evaluate(run: Run, name: str) -> dict | None:
    """Every rank evaluates its share of the held-out questions with the run's generator; rank 0 writes the merged
    results under <run>/eval/."""
    cfg = run.cfg
    if not run.eval_rows:
        return None
    memory.reset_peak()
    with run.amp():
        summary = evaluation.evaluate(run.generator, run.tokenizer, run.eval_rows, run.tools,
                                      evaluation.eval_settings(cfg), name=name,
                                      out_dir=run.dir / "eval", config=dataclasses.asdict(cfg), rank=run.rank,
                                      world=run.world, progress=run.master)
    peak = memory.peak_gb()
    memory.release()                             # the generation's freed memory back before training goes on
    run.log(f"eval {name}: " + runlog.eval_line(summary) + (f" | peak memory {peak:.1f} GB" if peak else ""))
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and advantages of the step's trajectories (this rank's questions; a question's k trajectories are all here)


def rewards_of(scores: list[dict], trajectories, cfg) -> torch.Tensor:
    """(N,) rewards: each score's reward (algorithm.md §5), plus the soft overlong penalty (--overlong_cache)."""
    rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    if cfg.overlong_cache:
        lengths = torch.tensor([len(t.response_ids) for t in trajectories])
        rewards = rewards + advantage.overlong_penalty(lengths, cfg.max_response_tokens, cfg.overlong_cache)
    return rewards


def keep_varied_groups(rows, trajectories, scores, rewards, tree_stats: dict, n_keep: int):
    """DAPO's dynamic sampling over the 2·n_keep questions rolled out: the first n_keep groups whose rewards differ
    (then, if too few differ, equal-reward groups, whose advantage is 0) in their rollout order, renumbered 0..n-1;
    the tree statistics of the kept groups (the tool counts stay those of every call that ran)."""
    groups = torch.tensor([t.group_id for t in trajectories])
    varied = advantage.dynamic_sampling_mask(rewards, groups)
    order = sorted(range(len(rows)), key=lambda g: (not bool(varied[groups == g].any()), g))[:n_keep]
    new_id = {g: i for i, g in enumerate(order)}
    keep = [i for i, t in enumerate(trajectories) if t.group_id in new_id]
    keep.sort(key=lambda i: (new_id[trajectories[i].group_id], trajectories[i].traj_id))
    for i in keep:
        trajectories[i].group_id = new_id[trajectories[i].group_id]
    kept = [trajectories[i] for i in keep]
    m_kept = [tree_stats["m_per_question"][g] for g in order]
    kept_stats = rollout.tree_stats(kept, m_kept, tree_stats, tree_stats["rounds"])
    return [rows[g] for g in order], kept, [scores[i] for i in keep], rewards[keep], kept_stats


def outcome_advantages(trajectories, rewards: torch.Tensor, cfg, pad_id: int) -> torch.Tensor:
    """(N, W) per-token advantage, 0 at mask-0 tokens, in the layout of one `tensorize` of all the rank's trajectories
    (micro_batches cuts each micro-batch's columns): the group advantage A_j at every token of trajectory j (§3a;
    Dr. GRPO without the std), or GiGPO's A^E + ω·A^S (§7)."""
    groups = torch.tensor([t.group_id for t in trajectories])
    full = tensorize([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajectories], pad_id, "cpu")
    if cfg.gigpo:
        return advantage.gigpo_advantages(full.input_ids[:, 1:], full.mask, groups, rewards, std_norm=cfg.std_norm)
    return advantage.group_advantages(rewards, groups, std_norm=cfg.std_norm)[:, None] * full.mask


# ---------------------------------------------------------------------------------------------------------------------
# Mini-batches of whole questions, micro-batches for memory; the old-policy pass (§3b) and the update (§4)


@dataclasses.dataclass
class OldPolicy:
    """What the old-policy pass gives one micro-batch, each (b, L-1) like its mask: π_old's log-probs and token
    entropies at the rollout temperature, the reference's log-probs (None without a reference), and Ã (§3b), the
    advantage the update weighs each token by (0 at mask-0 tokens)."""
    old_logp: torch.Tensor
    entropy: torch.Tensor
    ref_logp: torch.Tensor | None
    adv_tilde: torch.Tensor


@torch.no_grad()
def old_policy_pass(policy, ref, batches: list[list], cfg, amp, correction: mismatch.Correction | None = None
                    ) -> tuple[list[list[OldPolicy]], torch.Tensor, mismatch.MismatchSums]:
    """π_old's log-probs and entropies (at the rollout temperature) and the reference's for every micro-batch, and
    Ã = A·(1 + α·sg(z(H))) (§3b) z-scored with entropy statistics over all ranks; with --reinforce_pp A is
    first the batch-normalised per-token return (§7). Returns an OldPolicy per micro-batch (nested as `batches`)
    and, summed over all ranks, the old policy's entropy statistics [count, ΣH, ΣH²] and the generator–trainer
    mismatch (harness/mismatch.py) under `correction` (the run's, Run.correction; None: cfg's, for a call outside a
    run)."""
    unwrap(policy).eval()
    flat = [mb for mbs in batches for mb in mbs]
    stats, sums = torch.zeros(3, dtype=torch.float64), mismatch.MismatchSums.zeros()
    correction = settings.correction(cfg) if correction is None else correction
    old_logps, entropies, ref_logps = [], [], []
    with amp():
        for i, mb in enumerate(flat):
            with located(f"the old-policy pass, micro-batch {i} of {len(flat)}"):
                old_logp, entropy = policy(mb.input_ids, mb.attention_mask, mb.mask, cfg.temperature)
            ref_logp = None
            if ref is not None:
                ref_logp, _ = ref(mb.input_ids, mb.attention_mask, mb.mask, cfg.temperature)
            old_logps.append(old_logp)
            entropies.append(entropy)
            ref_logps.append(ref_logp)
            stats += advantage.entropy_stats(entropy, mb.mask).cpu()
            if mb.gen_logp is not None:
                sums += mismatch.mismatch_stats(old_logp, mb.gen_logp, mb.mask, correction, mb.misfit)
    stats = parallel.all_reduce_sum(stats)
    sums = mismatch.MismatchSums.from_vector(parallel.all_reduce_sum(sums.vector()))
    mean_h, std_h = advantage.mean_std(stats)
    adv = [mb.adv for mb in flat]               # A per token (§3a)
    if cfg.reinforce_pp:                        # returns with the KL in the reward, normalised over all ranks
        kl = cfg.kl_coef
        returns = [advantage.reinforce_pp_returns(mb.reward, mb.mask, *((old_logp, ref_logp) if kl else ()), beta=kl)
                   for mb, old_logp, ref_logp in zip(flat, old_logps, ref_logps)]
        ret_stats = sum(advantage.token_stats(g, mb.mask, "returns").cpu() for g, mb in zip(returns, flat))
        mean_g, std_g = advantage.mean_std(parallel.all_reduce_sum(ret_stats))
        adv = [advantage.reinforce_pp_advantages(g, mb.mask, mean_g, std_g) for g, mb in zip(returns, flat)]
    olds = []
    for mb, a, old_logp, entropy, ref_logp in zip(flat, adv, old_logps, entropies, ref_logps):
        if cfg.entropy_advantage:
            adv_tilde = advantage.entropy_weighted_advantages(a, entropy, mb.mask, mean_h, std_h, cfg.alpha)
        else:
            adv_tilde = a * mb.mask
        olds.append(OldPolicy(old_logp, entropy, ref_logp, adv_tilde))
    per_mini_batch, start = [], 0
    for mbs in batches:
        per_mini_batch.append(olds[start:start + len(mbs)])
        start += len(mbs)
    return per_mini_batch, stats, sums


def accumulate_gradients(policy, mbs: list, olds: list[OldPolicy], cfg, world: int, amp, where: str,
                         objective: loss.LossSettings | None = None,
                         correction: mismatch.Correction | None = None) -> dict:
    """The forward and backward of loss.policy_loss over the micro-batches of one optimiser mini-batch, each with its
    old-policy pass (`olds`), accumulating gradients (DDP syncs them on the last), normalised by the mini-batch's
    token and sequence counts over all ranks (N_valid, N_seq; × world undoes the ranks' gradient average).
    objective, correction: the run's, built once at set-up (Run.objective, Run.correction; None: cfg's, for a call
    outside a run). Returns the loss metrics summed."""
    objective = settings.loss_settings(cfg) if objective is None else objective
    correction = settings.correction(cfg) if correction is None else correction
    counts = torch.tensor([sum(float(mb.mask.sum()) for mb in mbs), sum(len(mb.mask) for mb in mbs)],
                          dtype=torch.float64)
    n_valid, n_seqs = parallel.all_reduce_sum(counts).tolist()
    sums = Counter()
    for i, (mb, old) in enumerate(zip(mbs, olds)):
        with no_grad_sync(policy, last=i == len(mbs) - 1), located(f"{where}, micro-batch {i}"):
            with amp():
                logp, entropy = policy(mb.input_ids, mb.attention_mask, mb.mask, cfg.temperature)
            value, metrics = loss.policy_loss(logp, old.old_logp, old.adv_tilde, mb.mask, n_valid, objective,
                                              ref_logp=old.ref_logp, entropy=entropy, n_seqs=n_seqs,
                                              weights=correction.weights(old.old_logp, mb.gen_logp, mb.mask))
            loss.check_finite("the loss", value)
            (value * world).backward()
        sums.update({key: float(v) for key, v in metrics.items()})
    return dict(sums)


# ---------------------------------------------------------------------------------------------------------------------
# The command


def main(argv=None, *, score=reward.score_response, make_generator=generation.make_generator) -> dict:
    cfg = config.parse_config(argv)
    if cfg.resume:                               # the run's own settings, unless a flag changes them
        cfg = config.parse_config(argv, defaults=rundir.saved_config(rundir.resumed_run(cfg)))
    rank, world, device = parallel.init(cfg.device)
    state = rundir.RunState()
    try:
        out = train(cfg, rank, world, device, state, score=score, make_generator=make_generator)
    except BaseException as err:                 # a new run that finished no step leaves no folder
        message = state.stop(cfg, rank, world)
        if isinstance(err, KeyboardInterrupt) or cli.stop_requested():     # Ctrl-C or SIGTERM, maybe mid-write
            raise cli.Interrupted(message) from None                       # one line (cli.run_cli prints it)
        raise
    finally:
        if state.tools is not None:
            state.tools.close()
        if state.lock is not None:               # a killed run's lock goes with its process
            rundir.unlock(state.lock)
    parallel.close()
    return out


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
