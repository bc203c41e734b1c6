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
with them), gradients and logged metrics. The machinery is in harness/.

Deviations from the paper / official code (algorithm.md §8): D14 (old-policy entropy z-scored over the batch on all
ranks), D16 (the loss divided by the mini-batch's global token count), D26 (optional supervised cold start), D27
(torchrun processes; under FSDP2 the transformers backend generates with an unsharded copy of the policy).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import torch

import advantage
import eval as evaluation
import loss
import reward
import rollout
import tools
from harness import (checkpoint, cli, coldstart, config, dataset, generation, models, parallel, runlog,
                     search as search_mod, trees)
from harness.policy import (backward_micro_batches, full_named_parameters, is_sharded, load_policy, optimizer_step,
                            tensorize, unwrap)

# ---------------------------------------------------------------------------------------------------------------------
# The training run


def main(argv=None) -> dict:
    cfg = config.parse_config(argv)
    if cfg.resume:                               # the run's own settings, unless a flag changes them
        cfg = config.parse_config(argv, defaults=runlog.saved_config(runlog.resumed_run(cfg)))
    rank, world, device = parallel.init(cfg.device, cfg.dist_timeout_min)
    state = runlog.RunState()
    try:
        out = train(cfg, rank, world, device, state)
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


def train(cfg, rank: int, world: int, device: torch.device, state: runlog.RunState | None = None) -> dict:
    from tqdm import tqdm
    master = rank == 0
    state = state or runlog.RunState()

    def log(line: str) -> None:
        if master:
            tqdm.write(line)

    amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if cfg.bf16 else contextlib.nullcontext
    parallel.seed_all(cfg.seed + rank)

    # -------------------------------------------------------------------------------- checks, tools, data (no run yet)
    cfg, note = config.fit_world(cfg, world)
    if note:
        log(note)
    config.check_files(cfg)
    run_dir, ckpts = runlog.plan_run(cfg)
    base_path = parallel.on_rank0(lambda: models.resolve_model(cfg))   # rank 0 converts the embedded model once
    tokenizer = models.load_tokenizer(base_path)
    search_kw = {"cache": cfg.cache_dir, **cfg.search_kw} if cfg.search == "bm25" and cfg.cache_dir else cfg.search_kw
    search = search_mod.make_search(cfg.search, **search_kw)
    search_mod.check_reachable(search)
    log(config.python_isolation(cfg.python_isolation))                # every rank runs its own python calls
    tool_runner = state.tools = tools.Tools(search, python_timeout_s=cfg.python_timeout_s,
                                            python_kw={"max_processes": cfg.python_max_processes})
    train_rows = dataset.load_questions(cfg.train_data, tokenizer, cfg.max_prompt_tokens, "train_data", cfg.skip_bad)
    eval_rows = dataset.load_questions(cfg.eval_data, tokenizer, cfg.max_prompt_tokens, "eval_data",
                                       cfg.skip_bad)[:cfg.eval_limit or None] if cfg.eval_data else []
    demos, train_rows = coldstart.demonstrations(cfg, train_rows, search)
    if len(train_rows) < cfg.questions_per_step:
        raise cli.UserError(f"--train_data has {len(train_rows)} usable questions, fewer than "
                            f"--questions_per_step ({cfg.questions_per_step})")
    steps = cfg.steps or cfg.epochs * len(train_rows) // cfg.questions_per_step
    state.run_dir, state.created, state.steps = run_dir, not cfg.resume, steps
    info = runlog.create_run(cfg, run_dir, world, master)              # everything checked: the run folder
    log(f"{len(train_rows)} training questions, {len(eval_rows)} held-out, {len(demos)} demonstrations; "
        f"{steps} steps of {cfg.questions_per_step} questions × k={cfg.k}; {world} process(es) on {device}")

    # -------------------------------------------------------------------------------- the policy (and its cold start)
    # start from the latest checkpoint, a cached cold start, or the base model
    cs_dir = config.cache_dir(cfg.cache_dir) / "cold_start" / coldstart.cold_start_key(base_path, demos, cfg, world) \
        if demos else None
    need_cold_start = bool(demos) and not (cs_dir / "config.json").exists() and not cfg.resume
    init_path = str(ckpts[-1]) if cfg.resume else (str(cs_dir) if demos and not need_cold_start else base_path)
    policy = load_policy(init_path, world, device, cfg.parallel, cfg.bf16, rank, cfg.gradient_checkpointing)
    if need_cold_start:
        log(f"cold start: {len(demos)} demonstrations, {cfg.cold_start_steps} steps (cached in {cs_dir})")
        coldstart.cold_start(policy, demos, tokenizer, cfg, rank, world, device, amp, log)
        checkpoint.export_model(policy, tokenizer, cs_dir, rank)
        init_path = str(cs_dir)
    ref = None
    if cfg.kl_coef > 0:                          # frozen reference: the policy RL starts from (also on --resume)
        ref = load_policy(str(cs_dir) if demos else base_path, world, device, cfg.parallel, cfg.bf16, rank)
        ref = unwrap(ref).requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    # -------------------------------------------------------------------------------- generator
    # vLLM: one engine per rank; transformers: the policy itself, or an unsharded copy under FSDP2 (D27)
    gen_lm = None
    if cfg.backend == "vllm":
        generator = generation.VLLMGenerator(init_path, temperature=cfg.temperature, top_p=cfg.top_p,
                                             gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                                             seed=cfg.seed + rank,
                                             max_model_len=cfg.max_prompt_tokens + cfg.max_response_tokens)
        parallel.on_close(generator.close)       # the engine shuts down before the process group is left
        parallel.seed_all(cfg.seed + rank)                # building the engine re-seeded the global RNGs
    else:
        gen_lm = models.load_lm(init_path, device) if is_sharded(policy) else unwrap(policy).lm
        generator = generation.TransformersGenerator(gen_lm, tokenizer, temperature=cfg.temperature,
                                                     top_p=cfg.top_p, batch_size=cfg.gen_batch_size)

    def sync_generator():
        """The new weights to the generator after the update (a collective under FSDP2)."""
        if cfg.backend == "vllm":
            generator.wake_up(full_named_parameters(policy, generator.dtype))
        elif gen_lm is not unwrap(policy).lm:
            generator.load_weights(full_named_parameters(policy))

    def run_eval(name: str) -> dict | None:
        """Every rank evaluates its share of the held-out questions; rank 0 writes the merged results."""
        if not eval_rows:
            return None
        with amp():
            summary = evaluation.evaluate(
                gen_lm, tokenizer, eval_rows, tool_runner, n=cfg.eval_n, temperature=cfg.eval_temperature,
                top_p=cfg.eval_top_p, max_response_tokens=cfg.max_response_tokens, batch_size=cfg.gen_batch_size,
                out_dir=run_dir / "eval", name=name, max_tool_calls=cfg.max_tool_calls, seed=cfg.seed,
                generator=generator, config=dataclasses.asdict(cfg), rank=rank, world=world, progress=master)
        log(f"eval {name}: " + runlog.eval_line(summary))
        return summary

    # -------------------------------------------------------------------------------- resume, evaluation before
    start_step = 0
    if cfg.resume:
        start_step = checkpoint.load(ckpts[-1], policy, optimizer, rank)
        log(f"resumed {run_dir} from {ckpts[-1].name} (step {start_step})")
        if master:
            runlog.trim_logs(run_dir, start_step)
    state.first_step = state.steps_done = start_step
    n_opt_steps = start_step * cfg.questions_per_step // cfg.mini_batch_size * cfg.ppo_epochs
    trackers = runlog.Trackers(cfg, run_dir, master)
    evals = {}
    before = run_eval("before") if start_step == 0 and cfg.eval_before else runlog.saved_eval(run_dir, "before")
    if before:
        evals["before"] = before["pass@1"]

    # -------------------------------------------------------------------------------- the loop
    q_local = cfg.questions_per_step // world
    n_minibatches = cfg.questions_per_step // cfg.mini_batch_size
    bar = tqdm(total=steps, initial=start_step, desc="train", unit="step", disable=not master, dynamic_ncols=True)
    metrics = {}
    for step in range(start_step, steps):
        t0 = time.time()
        rows = dataset.step_questions(train_rows, step, cfg.questions_per_step, cfg.seed)[rank * q_local:
                                                                                          (rank + 1) * q_local]
        if cfg.dynamic_sampling:                 # DAPO: as many again, to keep the groups whose rewards differ
            rows += dataset.spare_questions(train_rows, step, q_local, cfg.seed * world + rank)

        # ---- rollout (algorithm.md §2): k trajectories per question, tree-structured
        prompts = [tools.build_prompt(tokenizer, r["question"]) for r in rows]
        progress = runlog.RolloutProgress(bar, generator) if master else None
        with torch.no_grad(), amp():
            trajectories, rollout_stats = rollout.tree_rollout(
                prompts, generator, tool_runner, tokenizer, k=cfg.k, beta=cfg.beta, gamma=cfg.gamma, lam=cfg.lam,
                tau=cfg.tau, dynamic_budget=cfg.dynamic_budget, entropy_branching=cfg.entropy_branching,
                max_tool_calls=cfg.max_tool_calls, max_response_tokens=cfg.max_response_tokens,
                seed=(cfg.seed * 100_003 + step) * world + rank, progress=progress,
                tool_limit_ends=cfg.tool_limit_ends)
        if progress:
            progress.detach()
        if cfg.backend == "vllm":
            generator.sleep()
        t_rollout = time.time() - t0

        # ---- reward (algorithm.md §5) and outcome advantage (§3a; GiGPO's step advantage, §7)
        scores, rewards = score(rows, trajectories, cfg)
        if cfg.dynamic_sampling:
            rows, trajectories, scores, rewards, rollout_stats = keep_varied_groups(
                rows, trajectories, scores, rewards, rollout_stats, q_local)
        adv = outcome_advantages(trajectories, rewards, cfg, tokenizer.pad_token_id)

        # ---- old-policy log-probs and token entropies (one no-grad pass), entropy-aware advantage (§3b)
        t1 = time.time()
        batches = micro_batches(trajectories, adv, n_minibatches, cfg, tokenizer.pad_token_id, device, rewards)
        stats, std_h = old_policy_pass(policy, ref, batches, cfg, amp)
        t_old = time.time() - t1

        # ---- policy update (algorithm.md §4): ppo_epochs × mini-batches, each one optimiser step
        t2 = time.time()
        unwrap(policy).lm.train()
        sums: dict[str, float] = {}
        grad_norms = []
        for epoch in range(cfg.ppo_epochs):
            for j, mbs in enumerate(batches):
                lr = cfg.lr * min(1.0, (n_opt_steps + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for key, v in accumulate_gradients(policy, mbs, cfg, world, amp,
                                                   f"step {step + 1}, epoch {epoch}, mini-batch {j}").items():
                    sums[key] = sums.get(key, 0.0) + v
                grad_norms.append(optimizer_step(policy, optimizer, cfg.grad_clip))
                n_opt_steps += 1
        unwrap(policy).lm.eval()

        # ---- new weights to the generator
        sync_generator()
        t_update = time.time() - t2

        # ---- log: sums over ranks divided by global counts (definitions in docs/reference.md)
        metrics = runlog.step_metrics(step + 1, rows, trajectories, scores, rewards, adv, rollout_stats, stats, std_h,
                                      sums, grad_norms)
        metrics.update({"lr": lr, "time/rollout": t_rollout, "time/old_logp": t_old, "time/update": t_update,
                        "time/step": time.time() - t0,
                        "update_tokens_per_s": metrics["n_valid_tokens"] * cfg.ppo_epochs / max(t_update, 1e-9)})
        step_trees = parallel.gather(trees.records(step + 1, rows, trajectories, rollout_stats["m_per_question"],
                                                   rewards))
        state.steps_done = step + 1
        if master:
            runlog.write_step(run_dir, metrics, rows, trajectories, scores, rewards, cfg.log_samples)
            trees.append(run_dir / "trees.jsonl", [rec for recs in step_trees for rec in recs])
            trackers.log(metrics, step + 1)
            bar.set_postfix_str("")
            bar.update(1)
            log(runlog.format_line(step + 1, steps, metrics))
            for tool, errors, calls in runlog.failing_tools(metrics):
                backend = repr(search) if tool == "search" else "the python sandbox"
                log(f"warning: {tool} failed on {errors} of {calls} calls this step ({backend}); last error: "
                    f"{runlog.last_error(trajectories, tool) or 'on another rank'}")

        # ---- periodic evaluation and checkpoint
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < steps:
            run_eval(f"step{step + 1}")
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == steps:
            checkpoint.save(run_dir, step + 1, policy, optimizer, tokenizer, rank=rank, keep=cfg.keep_checkpoints,
                            config_yaml=runlog.config_yaml(cfg), info=info,
                            data_position=(step + 1) * cfg.questions_per_step,
                            export_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
                            trainer_state=cfg.save_trainer_state)
    bar.close()

    # -------------------------------------------------------------------------------- evaluation after, plot
    after = run_eval("after") if start_step < steps else None
    if after:
        evals["after"] = after["pass@1"]
    if master and (run_dir / "metrics.jsonl").exists():
        runlog.plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", evals)
        trees.draw(trees.load(run_dir / "trees.jsonl"), run_dir / "trees.png", f"{run_dir.name}: the last step's trees")
        log(f"run directory: {run_dir}")
    trackers.close()
    return {"run_dir": str(run_dir), "last": metrics, "evals": evals, "steps": steps}


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and advantages of the step's trajectories (this rank's questions; a question's k trajectories are all here)


def score(rows: list[dict], trajectories, cfg) -> tuple[list[dict], torch.Tensor]:
    """(score_response of each trajectory, (N,) rewards): the deep-research reward against the trajectory's own
    question's golds, plus DAPO's soft overlong penalty when --overlong_cache is set."""
    golds = [rows[t.group_id]["golds"] for t in trajectories]
    scores = [reward.score_response(t.text, g) for t, g in zip(trajectories, golds)]
    rewards = torch.tensor([reward.deep_research_reward(t.text, g) for t, g in zip(trajectories, golds)],
                           dtype=torch.float32)
    if cfg.overlong_cache:
        lengths = torch.tensor([len(t.response_ids) for t in trajectories])
        rewards = rewards + advantage.overlong_penalty(lengths, cfg.max_response_tokens, cfg.overlong_cache)
    return scores, rewards


def keep_varied_groups(rows, trajectories, scores, rewards, rollout_stats, n_keep: int):
    """DAPO's dynamic sampling over the 2·n_keep questions rolled out: the first n_keep groups whose rewards differ
    (then, if too few differ, equal-reward groups, whose advantage is 0) in their rollout order, renumbered 0..n-1."""
    groups = torch.tensor([t.group_id for t in trajectories])
    varied = advantage.dynamic_sampling_mask(rewards, groups)
    order = sorted(range(len(rows)), key=lambda g: (not bool(varied[groups == g].any()), g))[:n_keep]
    new_id = {g: i for i, g in enumerate(order)}
    keep = [i for i, t in enumerate(trajectories) if t.group_id in new_id]
    keep.sort(key=lambda i: (new_id[trajectories[i].group_id], trajectories[i].traj_id))
    for i in keep:
        trajectories[i].group_id = new_id[trajectories[i].group_id]
    stats = {**rollout_stats, "m_per_question": [rollout_stats["m_per_question"][g] for g in order]}
    return [rows[g] for g in order], [trajectories[i] for i in keep], [scores[i] for i in keep], rewards[keep], stats


def outcome_advantages(trajectories, rewards: torch.Tensor, cfg, pad_id: int) -> torch.Tensor:
    """(N,) group advantages A_j (§3a; Dr. GRPO without the std), or with --gigpo (N, W) per-token A^E + ω·A^S in
    the layout of one tensorize of all the rank's trajectories (micro_batches cuts each micro-batch's columns)."""
    groups = torch.tensor([t.group_id for t in trajectories])
    if not cfg.gigpo:
        return advantage.group_advantages(rewards, groups, std_norm=cfg.std_norm)
    full = tensorize([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajectories], pad_id, "cpu")
    return advantage.gigpo_advantages(full.input_ids[:, 1:], full.mask, groups, rewards, omega=cfg.gigpo_omega,
                                      std_norm=cfg.std_norm)


# ---------------------------------------------------------------------------------------------------------------------
# Mini-batches of whole questions, micro-batches for memory; the old-policy pass (§3b) and one optimiser mini-batch (§4)


def micro_batches(trajectories, adv: torch.Tensor, n_minibatches: int, cfg, pad_id: int, device,
                  rewards: torch.Tensor | None = None):
    """Split this rank's trajectories (ordered by question) into n_minibatches mini-batches of whole questions, each
    into micro-batches of <= micro_batch_size trajectories. Returns a list (per mini-batch) of lists of MicroBatch."""
    per_mini = len(trajectories) // n_minibatches
    out = []
    for j in range(n_minibatches):
        chunk = list(range(j * per_mini, (j + 1) * per_mini))
        mbs = []
        for s in range(0, len(chunk), cfg.micro_batch_size):
            idx = chunk[s:s + cfg.micro_batch_size]
            mb = tensorize([(trajectories[i].prompt_ids, trajectories[i].response_ids, trajectories[i].loss_mask)
                            for i in idx], pad_id, device)
            width = mb.mask.shape[1]
            mb.adv = (adv[idx] if adv.dim() == 1 else adv[idx, :width]).to(device)     # (b,) A_j or (b, L-1)
            mb.reward = None if rewards is None else rewards[idx].to(device)
            mbs.append(mb)
        out.append(mbs)
    return out


@torch.no_grad()
def old_policy_pass(policy, ref, batches: list[list], cfg, amp) -> tuple[torch.Tensor, float]:
    """Fill every micro-batch with old_logp and entropy (π_old at the rollout temperature), ref_logp (with a
    reference), and adv_tok = Ã (§3b) z-scored with entropy statistics over all ranks; with --reinforce_pp the
    advantage is first the batch-normalised per-token return (§7). Returns the local [count, ΣH, ΣH²] and the global
    std of H."""
    unwrap(policy).eval()
    stats = torch.zeros(3, dtype=torch.float64)
    flat = [mb for mbs in batches for mb in mbs]
    with amp():
        for mb in flat:
            mb.old_logp, mb.entropy = policy(mb.input_ids, mb.attention_mask, mb.mask, cfg.temperature,
                                             cfg.logp_chunk_size)
            if ref is not None:
                mb.ref_logp, _ = ref(mb.input_ids, mb.attention_mask, mb.mask, cfg.temperature, cfg.logp_chunk_size)
            stats += advantage.entropy_stats(mb.entropy, mb.mask).cpu()
    mean_h, std_h = advantage.mean_std(parallel.all_reduce_sum(stats))                  # over all ranks
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
            mb.adv_tok = (mb.adv[:, None] if mb.adv.dim() == 1 else mb.adv) * mb.mask
    return stats, std_h


def accumulate_gradients(policy, mbs: list, cfg, world: int, amp, where: str) -> dict:
    """Backward of loss.policy_loss over the micro-batches of one mini-batch, normalised by the mini-batch's token
    and sequence counts over all ranks (N_valid, N_seq). Returns the loss metrics summed."""
    counts = torch.stack([sum(mb.mask.sum() for mb in mbs).double(),
                          torch.tensor(float(sum(len(mb.mask) for mb in mbs)), dtype=torch.float64)])
    n_valid, n_seqs = parallel.all_reduce_sum(counts).tolist()

    def objective(mb, logp, entropy):
        return loss.policy_loss(
            logp, mb.old_logp, mb.adv_tok, mb.mask, n_valid, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
            clip_c=cfg.clip_c, sg_clip=cfg.sg_clip, ref_logp=mb.ref_logp, kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,
            sg_clip_low=cfg.sg_clip_low, cispo=cfg.cispo, entropy=entropy if cfg.entropy_coeff else None,
            entropy_coeff=cfg.entropy_coeff, loss_agg=cfg.loss_agg, n_seqs=n_seqs, max_len=cfg.max_response_tokens)

    return backward_micro_batches(policy, mbs, world, amp, cfg.temperature, cfg.logp_chunk_size, objective, where)


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
