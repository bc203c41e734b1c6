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

Deviations from the paper / official code (algorithm.md §8): D14 (old-policy entropy z-scored over the batch on all
ranks), D16 (the loss divided by the mini-batch's global token count), D26 (optional supervised cold start), D27
(torchrun processes; under FSDP2 the transformers backend generates with an unsharded copy of the policy).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import Counter

import torch

import advantage
import eval as evaluation
import loss
import reward
import rollout
import tools
from harness import cli, config, dataset, generation, trees
from harness.run import checkpoint, parallel, rundir, runlog
from harness.run.policy import (backward_micro_batches, full_named_parameters, micro_batches, optimizer_step,
                                pad_share, split_micro_batches, tensorize, unwrap)  # noqa: F401 -- train's API
from harness.run.startup import Run, set_up

# ---------------------------------------------------------------------------------------------------------------------
# One training step (this rank's questions; every rank runs it, the collectives are sums)


def rl_step(run: Run, step: int, progress=None) -> tuple[dict, runlog.StepBatch]:
    """Step `step` (0-based): rollout -> reward -> advantages -> old-policy pass -> update -> weights to the
    generator. Returns the step's metrics (means over all ranks) and what this rank rolled out (for the logs)."""
    cfg, t0 = run.cfg, time.time()
    rows = dataset.step_questions(run.train_rows, step, cfg.questions_per_step, cfg.seed)[
        run.rank * run.questions_here:(run.rank + 1) * run.questions_here]
    if cfg.dynamic_sampling:                     # DAPO: as many again, to keep the groups whose rewards differ
        rows += dataset.spare_questions(run.train_rows, step, run.questions_here, cfg.seed * run.world + run.rank)

    # ---- rollout (algorithm.md §2): k trajectories per question, tree-structured
    with torch.no_grad(), run.amp():
        trajectories, tree = rollout.tree_rollout(
            [tools.build_prompt(run.tokenizer, r["question"]) for r in rows], run.generator, run.tools, run.tokenizer,
            run.tree, sampling=run.sampling, seed=(cfg.seed * 100_003 + step) * run.world + run.rank,
            progress=progress)
    run.generator.sleep()                        # its memory to the update, where it has any to give (vLLM, GPU)
    t_rollout = time.time() - t0
    rank_times = parallel.gather(t_rollout)      # the slowest rank holds every other one at the next collective

    # ---- reward (algorithm.md §5), once per trajectory; DAPO keeps the groups whose rewards differ (§7)
    scores = [run.score(t.text, rows[t.group_id]["golds"]) for t in trajectories]
    rewards = rewards_of(scores, trajectories, cfg)
    if cfg.dynamic_sampling:
        rows, trajectories, scores, rewards, tree = keep_varied_groups(rows, trajectories, scores, rewards, tree,
                                                                       run.questions_here)

    # ---- outcome advantage A per token (§3a; GiGPO's step advantage, §7), mini-batches of whole questions
    t1 = time.time()
    adv = outcome_advantages(trajectories, rewards, cfg, run.tokenizer.pad_token_id)
    batches = micro_batches(trajectories, adv, rewards, cfg.questions_per_step // cfg.mini_batch_size, cfg,
                            run.tokenizer.pad_token_id, run.device)

    # ---- old-policy log-probs and token entropies (one no-grad pass), entropy-aware advantage Ã (§3b)
    entropy, mismatch = old_policy_pass(run.policy, run.ref, batches, cfg, run.amp)
    t_old = time.time() - t1

    # ---- policy update (algorithm.md §4): ppo_epochs × mini-batches, each one optimiser step
    t2 = time.time()
    losses, grad_norms, lr = update(run, batches, step)
    t_update = time.time() - t2

    # ---- the new weights to the generator (a collective under FSDP2)
    t3 = time.time()
    run.generator.update_weights(full_named_parameters(run.policy))
    t_sync = time.time() - t3

    batch = runlog.StepBatch(rows, trajectories, scores, rewards, tree["m_per_question"])
    metrics = runlog.step_metrics(step + 1, batch, tree, adv, entropy, losses, grad_norms)
    metrics.update(runlog.mismatch_metrics(mismatch))
    metrics.update({"lr": lr, "pad_share": pad_share(batches), "time/rollout": t_rollout, "time/old_logp": t_old,
                    "time/update": t_update, "time/sync": t_sync,
                    "time/rollout_slowest": max(rank_times),
                    "time/rollout_imbalance": max(rank_times) / max(1e-9, sum(rank_times) / len(rank_times)),
                    "time/step": time.time() - t0,
                    "update_tokens_per_s": metrics["n_valid_tokens"] * cfg.ppo_epochs / max(t_update, 1e-9)})
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
    probe = record_probe(run)                    # a fixed set of trajectories, for the policy's own entropy
    bar = tqdm(total=run.steps, initial=run.start_step, desc="train", unit="step", disable=not run.master,
               dynamic_ncols=True)
    metrics = {}
    for step in range(run.start_step, run.steps):
        metrics, batch = rl_step(run, step, runlog.RolloutProgress(bar) if run.master else None)
        if probe and (step + 1) % run.cfg.probe_every == 0:
            metrics["probe_entropy"] = probe_entropy(run, probe)
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
    after = evaluate(run, "after") if run.start_step < run.steps else None
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
    settings = evaluation.EvalSettings(n=cfg.eval_n, sampling=rollout.Sampling(cfg.eval_temperature, cfg.eval_top_p),
                                       max_response_tokens=cfg.max_response_tokens, max_tool_calls=cfg.max_tool_calls,
                                       batch_size=cfg.gen_batch_size, seed=cfg.seed, strict_format=cfg.strict_format)
    with run.amp():
        summary = evaluation.evaluate(run.generator, run.tokenizer, run.eval_rows, run.tools, settings, name=name,
                                      out_dir=run.dir / "eval", config=dataclasses.asdict(cfg), rank=run.rank,
                                      world=run.world, progress=run.master)
    run.log(f"eval {name}: " + runlog.eval_line(summary))
    return summary


def record_probe(run: Run) -> list:
    """The probe: one trajectory from each of the first --probe_questions held-out questions, sampled once by the
    starting policy at the rollout temperature and kept in <run>/probe.json (a resumed run reads it back), so that
    the policy's entropy is measured on the same tokens at every step (the sampled tokens' entropy moves with the
    questions each step draws and with what the tree samples)."""
    cfg, path = run.cfg, run.dir / "probe.json"
    if not cfg.probe_questions or not run.eval_rows:
        return []
    if path.exists():
        return [tuple(item) for item in json.loads(path.read_text())]
    rows = run.eval_rows[:cfg.probe_questions]
    with torch.no_grad(), run.amp():
        trajectories, _ = rollout.tree_rollout(
            [tools.build_prompt(run.tokenizer, r["question"]) for r in rows], run.generator, run.tools, run.tokenizer,
            run.tree, sampling=run.sampling, seed=cfg.seed, k=1, entropy_branching=False)
    probe = [(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajectories if sum(t.loss_mask)]
    if run.master:
        path.write_text(json.dumps(probe))
    return probe


@torch.no_grad()
def probe_entropy(run: Run, probe: list) -> float:
    """The current policy's mean token entropy H_t (algorithm.md §1) over the probe's policy tokens, teacher-forced
    (every rank computes it: a collective under FSDP2)."""
    unwrap(run.policy).eval()
    batch = tensorize(probe, run.tokenizer.pad_token_id, run.device)
    with run.amp():
        _, entropy = run.policy(batch.input_ids, batch.attention_mask, batch.mask, run.cfg.temperature,
                                run.cfg.logp_chunk_size)
    return float((entropy * batch.mask).sum() / batch.mask.sum())


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and advantages of the step's trajectories (this rank's questions; a question's k trajectories are all here)


def rewards_of(scores: list[dict], trajectories, cfg) -> torch.Tensor:
    """(N,) rewards: each score's reward (algorithm.md §5), plus DAPO's soft overlong penalty with --overlong_cache."""
    rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    if cfg.overlong_cache:
        lengths = torch.tensor([len(t.response_ids) for t in trajectories])
        rewards = rewards + advantage.overlong_penalty(lengths, cfg.max_response_tokens, cfg.overlong_cache)
    return rewards


def keep_varied_groups(rows, trajectories, scores, rewards, tree: dict, n_keep: int):
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
    kept_tree = rollout.tree_stats(kept, [tree["m_per_question"][g] for g in order], tree, tree["rounds"])
    return [rows[g] for g in order], kept, [scores[i] for i in keep], rewards[keep], kept_tree


def outcome_advantages(trajectories, rewards: torch.Tensor, cfg, pad_id: int) -> torch.Tensor:
    """(N, W) per-token advantage, 0 at mask-0 tokens, in the layout of one `tensorize` of all the rank's trajectories
    (micro_batches cuts each micro-batch's columns): the group advantage A_j at every token of trajectory j (§3a;
    Dr. GRPO without the std), or GiGPO's A^E + ω·A^S (§7)."""
    groups = torch.tensor([t.group_id for t in trajectories])
    full = tensorize([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajectories], pad_id, "cpu")
    if cfg.gigpo:
        return advantage.gigpo_advantages(full.input_ids[:, 1:], full.mask, groups, rewards, omega=cfg.gigpo_omega,
                                          std_norm=cfg.std_norm)
    return advantage.group_advantages(rewards, groups, std_norm=cfg.std_norm)[:, None] * full.mask


# ---------------------------------------------------------------------------------------------------------------------
# Mini-batches of whole questions, micro-batches for memory; the old-policy pass (§3b) and the update (§4)


@torch.no_grad()
def old_policy_pass(policy, ref, batches: list[list], cfg, amp) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill every micro-batch with old_logp and entropy (π_old at the rollout temperature), ref_logp (with a
    reference), and adv_tok = Ã (§3b) z-scored with entropy statistics over all ranks; with --reinforce_pp the
    advantage is first the batch-normalised per-token return (§7). Returns, over all ranks (one all-reduce), the old
    policy's entropy statistics [count, ΣH, ΣH²] and the generator–trainer mismatch sums (loss.mismatch_stats)."""
    unwrap(policy).eval()
    flat = [mb for mbs in batches for mb in mbs]
    local = torch.zeros(3 + 6 + loss.LOG_RATIO_EDGES[2], dtype=torch.float64)
    with amp():
        for mb in flat:
            mb.old_logp, mb.entropy = policy(mb.input_ids, mb.attention_mask, mb.mask, cfg.temperature,
                                             cfg.logp_chunk_size)
            if ref is not None:
                mb.ref_logp, _ = ref(mb.input_ids, mb.attention_mask, mb.mask, cfg.temperature, cfg.logp_chunk_size)
            local[:3] += advantage.entropy_stats(mb.entropy, mb.mask).cpu()
            if mb.gen_logp is not None:
                local[3:] += loss.mismatch_stats(mb.old_logp, mb.gen_logp, mb.mask).cpu()
    reduced = parallel.all_reduce_sum(local)
    stats, mismatch = reduced[:3], reduced[3:]
    mean_h, std_h = advantage.mean_std(stats)
    if cfg.reinforce_pp:                        # returns with the KL in the reward, normalised over all ranks
        kl = cfg.kl_coef if cfg.kl_in_reward else 0.0
        returns = [advantage.reinforce_pp_returns(mb.reward, mb.mask, *((mb.old_logp, mb.ref_logp) if kl else ()),
                                                  beta=kl) for mb in flat]
        ret_stats = sum(advantage.token_stats(g, mb.mask, "returns").cpu() for g, mb in zip(returns, flat))
        mean_g, std_g = advantage.mean_std(parallel.all_reduce_sum(ret_stats))
        for g, mb in zip(returns, flat):
            mb.adv = advantage.reinforce_pp_advantages(g, mb.mask, mean_g, std_g)
    for mb in flat:
        if cfg.entropy_advantage:
            mb.adv_tok = advantage.entropy_weighted_advantages(mb.adv, mb.entropy, mb.mask, mean_h, std_h, cfg.alpha)
        else:
            mb.adv_tok = mb.adv * mb.mask
    return stats, mismatch


def update(run: Run, batches: list[list], step: int) -> tuple[dict, list[float], float]:
    """ppo_epochs passes over the mini-batches, each one optimiser step, the learning rate warmed up over the run's
    optimiser steps. Returns the loss metrics summed over every call, the gradient norms and the last learning rate."""
    cfg = run.cfg
    unwrap(run.policy).lm.train()
    sums, grad_norms, lr = Counter(), [], cfg.lr
    for epoch in range(cfg.ppo_epochs):
        for j, mbs in enumerate(batches):
            opt_step = (step * cfg.ppo_epochs + epoch) * len(batches) + j       # optimiser steps before this one
            lr = cfg.lr * min(1.0, (opt_step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            sums.update(accumulate_gradients(run.policy, mbs, cfg, run.world, run.amp,
                                             f"step {step + 1}, epoch {epoch}, mini-batch {j}"))
            grad_norms.append(optimizer_step(run.policy, run.optimizer, cfg.grad_clip))
    unwrap(run.policy).lm.eval()
    return dict(sums), grad_norms, lr


def accumulate_gradients(policy, mbs: list, cfg, world: int, amp, where: str) -> dict:
    """Backward of loss.policy_loss over the micro-batches of one mini-batch, normalised by the mini-batch's token
    and sequence counts over all ranks (N_valid, N_seq). Returns the loss metrics summed."""
    counts = torch.stack([sum(mb.mask.sum() for mb in mbs).double(),
                          torch.tensor(float(sum(len(mb.mask) for mb in mbs)), dtype=torch.float64)])
    n_valid, n_seqs = parallel.all_reduce_sum(counts).tolist()

    def objective(mb, logp, entropy):
        weights = rollout_correction(mb, cfg)
        return loss.policy_loss(
            logp, mb.old_logp, mb.adv_tok, mb.mask, n_valid, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
            clip_c=cfg.clip_c, sg_clip=cfg.sg_clip, ref_logp=mb.ref_logp, kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,
            sg_clip_low=cfg.sg_clip_low, cispo=cfg.cispo, entropy=entropy if cfg.entropy_coeff else None,
            entropy_coeff=cfg.entropy_coeff, loss_agg=cfg.loss_agg, n_seqs=n_seqs, max_len=cfg.max_response_tokens,
            weights=weights)

    return backward_micro_batches(policy, mbs, world, amp, cfg.temperature, cfg.logp_chunk_size, objective, where)


def rollout_correction(mb, cfg):
    """The opt-in generator–trainer correction's per-token weights (loss.rollout_correction; algorithm.md §4b), or
    None when every switch is off."""
    band = (cfg.mismatch_low, cfg.mismatch_high)
    if not (cfg.tis_cap or cfg.mismatch_token_mask or cfg.mismatch_segment_mask or cfg.mismatch_sequence_mask):
        return None
    if mb.gen_logp is None or not torch.isfinite(mb.gen_logp[mb.mask.bool()]).any():
        raise cli.UserError("the mismatch correction needs the generator's log-probs, which this generator did not "
                            "give (vLLM gives them at --temperature 1 only)")
    weights, _ = loss.rollout_correction(mb.old_logp, mb.gen_logp, mb.mask, cfg.tis_cap,
                                         band if cfg.mismatch_token_mask else None,
                                         band if cfg.mismatch_segment_mask else None,
                                         band if cfg.mismatch_sequence_mask else None)
    return weights


# ---------------------------------------------------------------------------------------------------------------------
# The command


def main(argv=None, *, score=reward.score_response, make_generator=generation.make_generator) -> dict:
    cfg = config.parse_config(argv)
    if cfg.resume:                               # the run's own settings, unless a flag changes them
        cfg = config.parse_config(argv, defaults=rundir.saved_config(rundir.resumed_run(cfg)))
    rank, world, device = parallel.init(cfg.device, cfg.dist_timeout_min)
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
    parallel.close()
    return out


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
