"""The switches a real run combines, run together on 2 gloo ranks: a covering set of runs over parallel mode ×
micro-batching × mismatch correction × precision × gradient checkpointing × how unequal the ranks' trajectory
lengths are × the loss aggregation (token-mean, Dr. GRPO's sequence-normalised one) × LoRA (every pair of values
appears in some run), each run's step gradient compared with one process's on the same trajectories. The gradient
of one optimiser mini-batch does not depend on how it is cut into micro-batches and ranks (the loss divides by its
global token count, D18), so every combination must give one process's gradient."""
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

import rollout
import train
from harness import config, settings
from harness.lora import AdaptersOff
from harness.run import policy as policy_mod
from tests.conftest import free_port, hand_made_trajectories, peaked_tiny_model, with_adapters

FACTORS = (("parallel", ("ddp", "fsdp")), ("micro_batches", ("fixed", "token budget")),
           ("correction", ("off", "TIS + token mask")), ("precision", ("float32", "bfloat16")),
           ("checkpointing", ("off", "on")), ("lengths", ("equal", "unequal")),
           ("loss_agg", ("token-mean", "seq-mean-token-sum-norm")), ("lora", ("off", "rank 4")))
# A strength-2 covering array of eight two-level factors in six runs: factor f is at its second value in the runs of
# SUBSETS[f], distinct 3-subsets of runs 1..5 (two such subsets share one or two runs and each has one the other
# lacks; run 0 has every factor at its first value), so every pair of values of every two factors meets in some run.
SUBSETS = ((1, 2, 3), (1, 4, 5), (2, 4, 5), (3, 4, 5), (1, 2, 4), (2, 3, 5), (1, 3, 4), (2, 3, 4))
RUNS = [{name: values[run in SUBSETS[f]] for f, (name, values) in enumerate(FACTORS)} for run in range(6)]


def pairs_covered(runs) -> tuple[int, int]:
    """(pairs of values of two factors that some run has, all such pairs)."""
    seen = {(a, run[a], b, run[b]) for run in runs for a, b in itertools.combinations(run, 2)}
    total = sum(len(va) * len(vb) for (_, va), (_, vb) in itertools.combinations(FACTORS, 2))
    return len(seen), total


def test_the_runs_cover_every_pair():
    assert pairs_covered(RUNS) == (112, 112)
    assert pairs_covered(RUNS[:5])[0] < 112                    # fewer runs would leave pairs out


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
                         mismatch_masks=["token"] if run["correction"] != "off" else [], loss_agg=run["loss_agg"])


def step_gradient(policy, trajectories, rewards, cfg, world) -> tuple[dict, list[int]]:
    """One optimiser mini-batch as rl_step runs it (advantages, micro-batches, the old-policy pass in eval mode, the
    update in train mode, both under the run's precision), with the old log-probs moved by 0.4·sin(token id) so that
    ratios leave 1 and clipping happens. Returns the full gradients and this rank's micro-batch sizes."""
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if cfg.bf16 else contextlib.nullcontext
    adv = train.outcome_advantages(trajectories, rewards, cfg, 0)
    batches = train.micro_batches(trajectories, adv, rewards, 1, cfg, 0, "cpu")
    olds, _, _ = train.old_policy_pass(policy, None, batches, cfg, amp)
    for mb, old in zip(batches[0], olds[0]):
        old.old_logp = old.old_logp + 0.4 * torch.sin(mb.input_ids[:, 1:].float()) * mb.mask
    policy_mod.unwrap(policy).lm.train()
    train.accumulate_gradients(policy, batches[0], olds[0], cfg, world, amp, "test")
    grads = {}
    for name, p in policy_mod.unwrap(policy).named_parameters():
        if not p.requires_grad:                  # LoRA: the base weights are frozen
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.")] = grad.detach().clone()
    return grads, [len(mb.mask) for mb in batches[0]]


def make_policy(tokenizer, run, world):
    lm = peaked_tiny_model(tokenizer)
    if run["checkpointing"] == "on":
        policy_mod.enable_gradient_checkpointing(lm)
    policy = policy_mod.Policy(with_adapters(lm, b_scale=0.05) if run["lora"] != "off" else lm)
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
            natural = len(policy_mod.split_micro_batches(
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
    """Six 2-rank runs covering every pair of the seven settings: each run's gradient is one process's on the same
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


# ---------------------------------------------------------------------------------------------------------------------
# The repository's configs, run whole at toy size on 2 ranks: only what cannot run here is replaced


OFFICIAL = {"aepo_qwen3_14b": "qwen3", "aepo_qwen25_7b": "qwen2"}      # config -> the tiny model's architecture
ALGORITHMS = sorted(p.stem for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")
                    if p.stem not in OFFICIAL and p.stem != "embedded")


def tiny_model_of(family: str, tokenizer, path: Path) -> Path:
    """A random 2-layer model of the family's architecture (Qwen3: q/k norms; Qwen2: attention biases; llama: the
    tests' tiny model), saved with the test tokenizer; its output embeddings 40× larger (peaked_tiny_model: at init
    every entropy is ~log V with a spread of ~1e-5, which the entropy-aware advantage's z-score turns into noise)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    if family == "llama":
        lm = peaked_tiny_model(tokenizer)
    else:
        torch.manual_seed(0)
        config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                                     "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
        eos = tokenizer.eos_token_id
        lm = model_class(config_class(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=4096, tie_word_embeddings=False,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos))
        with torch.no_grad():
            lm.lm_head.weight.mul_(40.0)
    lm.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def toy_flags(label: str, root: Path, model: Path) -> list[str]:
    """--config configs/<name>.yaml (label: the name, or name-budget for token-budget micro-batches), then only what
    cannot run here: the model (a tiny random one), the data (the tests' QA set), the sizes (4 questions × k = 3 in
    2 mini-batches, 64 tokens, 2 steps, 1 held-out question once), the search (the replay table) and the backend
    (vLLM runs in the vLLM stage); the config's parallel mode, micro-batches, precision, checkpointing, correction,
    advantage and loss settings stay. The algorithm overlays start from the defaults, whose supervised cold start
    (the embedded run's) and held-out evaluation are off here: they are about the update."""
    over = dict(model=model, train_data=root / "qa.jsonl", eval_data=root / "qa.jsonl", eval_limit=1, eval_n=1,
                search="replay", search_kw=json.dumps({"path": str(root / "search.json")}), backend="transformers",
                k=3, questions_per_step=4, mini_batch_size=2, steps=2, max_response_tokens=64,
                out_dir=root / "runs", run_name=label, cache_dir=root / "cache")
    name, _, variant = label.partition("-")
    configs = [name] + (["lora"] if variant == "lora" else [])
    if variant == "budget":
        over["max_tokens_per_micro_batch"] = 700
    if name not in OFFICIAL:                     # about the update: no cold start, no held-out evaluation
        over.update(cold_start="false", eval_data="")
    return [f"--config={Path(__file__).parents[1] / 'configs' / c}.yaml" for c in configs] + \
        [f"--{k}={v}" for k, v in over.items()]


def _config_worker(rank, world, port, runs, out):
    """Each (name, argv) in one process group: train.train at toy size, recording the step-1 inputs of the update
    (this rank's trajectories and rewards after the rollout) and the gradient of its first mini-batch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))   # a hang fails
    from harness import config as config_mod
    from tests.fakes import fake_score
    real_micro_batches, real_accumulate = train.micro_batches, train.accumulate_gradients
    try:
        for name, argv in runs:
            seen = {}

            def micro_batches(trajectories, adv, rewards, n_minibatches, cfg, *args):
                seen.setdefault("inputs", (trajectories, rewards, n_minibatches))
                return real_micro_batches(trajectories, adv, rewards, n_minibatches, cfg, *args)

            def accumulate_gradients(policy, mbs, olds, cfg, *args):
                metrics = real_accumulate(policy, mbs, olds, cfg, *args)
                if "grads" not in seen:                  # step 1, epoch 0, mini-batch 0 (full tensors: a collective)
                    seen["cfg"], seen["sharded"] = dataclasses.asdict(cfg), policy_mod.is_sharded(policy)
                    seen["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                                     for n, p in policy_mod.unwrap(policy).named_parameters() if p.requires_grad}
                return metrics
            train.micro_batches, train.accumulate_gradients = micro_batches, accumulate_gradients
            started = time.monotonic()
            result = train.train(config_mod.parse_config(argv), rank, world, torch.device("cpu"), score=fake_score)
            seen.update(seconds=time.monotonic() - started, steps=result["steps"])
            torch.save(seen, f"{out}.{name}.{rank}")
            torch.distributed.barrier()
    finally:
        train.micro_batches, train.accumulate_gradients = real_micro_batches, real_accumulate
        torch.distributed.destroy_process_group()


def one_process_gradient(saved: list[dict], model: str) -> dict:
    """The step-1 gradient of the first mini-batch in one process from the ranks' own trajectories: each rank's
    mini-batch j is its j-th slice, so one process takes rank 0's slice j and rank 1's for each j in turn (the
    groups renumbered apart), with the run's own settings."""
    cfg = config.Config(**{k: v for k, v in saved[0]["cfg"].items()})
    n_mini = saved[0]["inputs"][2]
    union, rewards, offset = [], [], 0
    parts = []
    for rank, s in enumerate(saved):
        trajectories, r, _ = s["inputs"]
        per = len(trajectories) // n_mini
        groups = 1 + max(t.group_id for t in trajectories)
        parts.append([(trajectories[j * per:(j + 1) * per], r[j * per:(j + 1) * per], offset) for j in range(n_mini)])
        offset += groups
    for j in range(n_mini):
        for rank_parts in parts:
            trajectories, r, off = rank_parts[j]
            union += [dataclasses.replace(t, group_id=t.group_id + off) for t in trajectories]
            rewards.append(r)
    rewards = torch.cat(rewards)
    lora = settings.lora_settings(cfg)
    policy = policy_mod.load_policy(model, 1, torch.device("cpu"), bf16=cfg.bf16,
                                    gradient_checkpointing=cfg.gradient_checkpointing, lora=lora, seed=cfg.seed,
                                    packed=cfg.packed)
    ref = None
    if cfg.kl_coef > 0:
        ref = AdaptersOff(policy) if lora else \
            policy_mod.load_policy(model, 1, torch.device("cpu"), packed=cfg.packed).requires_grad_(False)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if cfg.bf16 else contextlib.nullcontext
    adv = train.outcome_advantages(union, rewards, cfg, 0)
    batches = train.micro_batches(union, adv, rewards, n_mini, cfg, 0, "cpu")
    olds, _, _ = train.old_policy_pass(policy, ref, batches, cfg, amp)
    policy.lm.train()
    train.accumulate_gradients(policy, batches[0], olds[0], cfg, 1, amp, "one process")
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


def run_configs(names, tokenizer, setup, tmp_path):
    import torch.multiprocessing as mp
    models = {}
    for family in {"llama", *OFFICIAL.values()}:
        models[family] = tiny_model_of(family, tokenizer, tmp_path / family)
    model_of = {name: models[OFFICIAL.get(name.partition("-")[0], "llama")] for name in names}
    runs = [(name, toy_flags(name, setup, model_of[name])) for name in names]
    mp.start_processes(_config_worker, args=(2, free_port(), runs, str(tmp_path / "seen")), nprocs=2,
                       start_method="spawn")
    print()
    for name in names:
        saved = [torch.load(f"{tmp_path / 'seen'}.{name}.{rank}", weights_only=False) for rank in (0, 1)]
        cfg = saved[0]["cfg"]
        run_dir = setup / "runs" / name
        assert saved[0]["steps"] == 2 and (run_dir / "checkpoints" / "step_000002" / "model.safetensors").exists()
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
        assert (run_dir / "eval" / "after_summary.json").exists() == (name.partition("-")[0] in OFFICIAL)
        assert (run_dir / "checkpoints" / "step_000002" / "adapter").exists() == bool(cfg.get("lora_rank"))
        one = one_process_gradient(saved, str(model_of[name]))
        two = {n.removeprefix("module."): g for n, g in saved[0]["grads"].items()}
        assert set(two) == set(one)
        diff = relative_difference(two, one)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in one.values()))
        assert saved[0]["sharded"] == (cfg["parallel"] == "fsdp")
        print(f"{name}: {cfg['parallel']}, bf16 {cfg['bf16']}, checkpointing {cfg['gradient_checkpointing']}, "
              f"LoRA rank {cfg['lora_rank']}, "
              f"micro-batch {cfg['micro_batch_size']}/{cfg['max_tokens_per_micro_batch']} tokens: "
              f"{saved[0]['seconds']:.1f} s, |g| {norm:.3g}, ‖g₂ − g₁‖/‖g₁‖ {diff:.2e}")
        assert norm > 0
        assert diff < (2e-2 if cfg["bf16"] else 1e-4), (name, diff)
    return {name: torch.load(f"{tmp_path / 'seen'}.{name}.0", weights_only=False) for name in names}


@pytest.mark.slow
def test_the_official_configs_run_whole_at_toy_size(tokenizer, setup, tmp_path):
    """configs/aepo_qwen3_14b.yaml and aepo_qwen25_7b.yaml on 2 ranks with their own FSDP2, bfloat16, gradient
    checkpointing and micro-batches (and the 14B one again with the token budget bench/README recommends, and with
    configs/lora.yaml): the run ends with its checkpoint and evaluation, and step 1's gradient is one process's."""
    run_configs(list(OFFICIAL) + ["aepo_qwen3_14b-budget", "aepo_qwen3_14b-lora"], tokenizer, setup, tmp_path)


@pytest.mark.slow
def test_every_algorithm_config_runs_on_two_ranks(tokenizer, setup, tmp_path):
    """Each baseline overlay of configs/ on 2 ranks: the run ends, and step 1's gradient is one process's."""
    run_configs(ALGORITHMS, tokenizer, setup, tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# A hang is named: the old bug, forced


def _hang_worker(rank, world, port, tok_dir, log_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=25))
    from transformers import AutoTokenizer
    from harness.run import watchdog
    log = open(Path(log_dir) / f"rank{rank}.txt", "w", buffering=1)
    policy_mod.even_out = lambda groups, count: groups        # the old bug: each rank keeps its own count
    run = {"parallel": "fsdp", "micro_batches": "token budget", "correction": "off", "precision": "float32",
           "checkpointing": "off", "lengths": "equal", "loss_agg": "token-mean", "lora": "off"}
    trajectories, rewards = hand_made_trajectories()
    mine = slice(rank * 4, (rank + 1) * 4)
    policy = make_policy(AutoTokenizer.from_pretrained(tok_dir), run, world)
    started = time.monotonic()
    watchdog.set_current(watchdog.Watchdog(rank, 3.0, out=log))
    try:
        step_gradient(policy, trajectories[mine], rewards[mine], run_config(run), world)
        print(f"finished after {time.monotonic() - started:.1f} s", file=log)
    except Exception as err:                                      # the collective timeout ends the forced hang
        print(f"ended after {time.monotonic() - started:.1f} s by {type(err).__name__}: {str(err)[:200]}", file=log)
    log.close()
    os._exit(0)                           # the process group is broken: tearing it down would abort the process


@pytest.mark.slow
def test_a_forced_hang_is_named_before_the_collective_timeout(tokenizer, tmp_path):
    """Ranks made to disagree on the number of micro-batches (even_out switched off: rank 0 packs 2, rank 1 one)
    under FSDP2: within the 3 s watchdog each rank says where it waits — rank 0 in the old-policy pass's second
    micro-batch (an FSDP2 all-gather), rank 1 in the all-reduce after its only one — before the 25 s collective
    timeout ends it."""
    import torch.multiprocessing as mp
    tokenizer.save_pretrained(tmp_path / "tok")
    mp.start_processes(_hang_worker, args=(2, free_port(), str(tmp_path / "tok"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    logs = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    print("\n" + "\n".join(logs))
    zero = "watchdog: rank 0 has been in the old-policy pass, micro-batch 1 of 2 (under FSDP2 every pass all-gathers"
    one = "watchdog: rank 1 has been waiting for the other ranks (an all-reduce)"
    assert zero in logs[0] and one in logs[1], logs
    for log in logs:                      # named first, then the timeout ended it (it never finished)
        assert "finished" not in log and log.index("watchdog:") < log.index("ended after")
