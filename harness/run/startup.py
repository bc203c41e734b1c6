"""Everything a training run needs before its first step, checked and built in order: settings, data, tools, the run
folder, the policy (with its cold start), the reference, the optimiser, the generator, and where a resume starts.

Nothing is created until every input has been checked (a mistake ends in one line, with no run folder). Under
several processes every rank calls `set_up`; rank 0 alone converts the embedded model and writes the run folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import loss
import rollout
import tools
from harness import cli, config, dataset, mismatch, models, plugins, search as search_mod, settings
from harness.run import checkpoint, coldstart, parallel, rundir, watchdog
from harness.lora import AdaptersOff, check_targets
from harness.run.policy import generator_weights, load_policy, trainable_parameters, unwrap


@dataclass
class Run:
    """A training run, set up: what the step and the loop read (nothing here changes after `set_up`)."""
    cfg: config.Config
    rank: int
    world: int
    device: torch.device
    dir: Path                                # the run folder
    info: dict                               # git commit, versions, start time (rundir.run_info)
    tokenizer: object
    search: object                           # the search backend (harness/search.py)
    tools: watchdog.WatchedTools             # tools.Tools, the watchdog told about each round
    train_rows: list[dict]
    eval_rows: list[dict]
    steps: int                               # the run's last step
    start_step: int                          # 0, or the step of the checkpoint a resume starts from
    policy: torch.nn.Module                  # harness.run.policy.Policy, placed for `world` processes
    ref: Callable | None                     # the KL reference (kl_coef > 0): a frozen copy, or the LoRA policy with
                                             # its adapters off (lora.AdaptersOff)
    optimizer: torch.optim.Optimizer
    generator: rollout.Generator             # the backend's, the watchdog told about each call
    tree_settings: rollout.TreeSettings      # the rollout's settings (algorithm.md §2)
    sampling: rollout.Sampling               # the rollout's sampling (temperature, top-p)
    objective: loss.LossSettings             # the update's objective (algorithm.md §4, §7)
    correction: mismatch.Correction          # the generator–trainer correction (algorithm.md §4b)
    score: Callable[[str, list], dict]       # reward.score_response (with --strict_format), or a test's stand-in
    log: Callable[[str], None]               # a line on rank 0

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def questions_here(self) -> int:
        """Questions per step on this rank."""
        return self.cfg.questions_per_step // self.world

    @property
    def packed(self) -> bool:
        """Whether the policy's forward is the padding-free one (decided when it was loaded: Policy.packed)."""
        return unwrap(self.policy).packed

    def step_questions(self, step: int) -> list[dict]:
        """This rank's questions of step `step` (0-based): its share of the step's questions, and with
        --dynamic_sampling (DAPO) as many again, of which the step keeps the groups whose rewards differ."""
        cfg, n = self.cfg, self.questions_here
        rows = dataset.step_questions(self.train_rows, step, cfg.questions_per_step, cfg.seed)[
            self.rank * n:(self.rank + 1) * n]
        if cfg.dynamic_sampling:
            rows += dataset.spare_questions(self.train_rows, step, n, cfg.seed * self.world + self.rank)
        return rows

    def rollout_seed(self, step: int) -> int:
        """The seed of this rank's rollout at step `step`: a different one for every run seed, step and rank."""
        return (self.cfg.seed * 100_003 + step) * self.world + self.rank

    def generator_weights(self):
        """The policy's weights as the generator takes them after a step (policy.generator_weights): all, gathered
        in the generator's weight dtype (vLLM's bfloat16), or with LoRA the adapter's tensors (the merged weights for
        a generator that cannot take an adapter)."""
        return generator_weights(self.policy, merged=not self.generator.takes_adapter,
                                 dtype=self.generator.weight_dtype)

    def amp(self):
        """bfloat16 autocast when --bf16 resolved to on (parallel.resolve_bf16), else nothing."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.cfg.bf16 else contextlib.nullcontext()


def set_up(cfg: config.Config, rank: int, world: int, device: torch.device, state: rundir.RunState, score,
           make_generator) -> Run:
    """Check the settings and inputs, then build the run (see `Run`). state: filled as the run takes shape, so that
    an interrupted start can say what was kept (rundir.RunState). score(text, golds, strict_format) ->
    reward.score_response's dict;
    make_generator: generation.make_generator, or a test's wrapper of it."""
    from tqdm import tqdm

    def log(line: str) -> None:
        if rank == 0:
            tqdm.write(line)

    parallel.seed_all(cfg.seed + rank)
    cfg = dataclasses.replace(cfg, bf16=parallel.resolve_bf16(cfg.bf16, device))    # the run's records say which
    cfg, note = config.fit_world(cfg, world)
    if note:
        log(note)
    rundir.check_files(cfg)
    if cfg.model == "embedded" or cfg.search == "bm25" or cfg.cold_start:   # the run writes to the cache what it lacks
        rundir.check_writable(str(config.cache_dir(cfg.cache_dir)), "cache_dir")
    run_dir, ckpts = rundir.plan_run(cfg, state)
    search_kw = {"cache": cfg.cache_dir, **cfg.search_kw} if cfg.search == "bm25" and cfg.cache_dir else cfg.search_kw
    search = search_mod.make_search(cfg.search, **search_kw)
    search_mod.check_reachable(search)
    base_path = parallel.node_first(lambda: models.resolve_model(cfg))   # each node converts the embedded model once
    tokenizer = models.load_tokenizer(base_path)
    if cfg.lora_rank:                            # the targets checked on the model's skeleton, before any work
        check_targets(models.skeleton(base_path), cfg.lora_target_modules)
    log(settings.python_isolation(cfg.python_isolation, cfg.python_limits))  # every rank runs its own python calls
    tool_runner = state.tools = settings.make_tools(search, cfg.python_limits, cfg.tools, cfg.mcp_server,
                                                    cfg.tool_format, tokenizer, cfg.model, cfg.observations_as_data)
    fmt = tool_runner.format                     # the tool-call format: prompts, stop strings, the format check
    if fmt.format_tags != tools.TAGS.format_tags:    # not the paper's search and python in tags: say what it has
        log(f"tools ({fmt.name} format): " + ", ".join(t.name for t in tool_runner.tools))
    scorer = run_score(cfg, score, fmt)
    train_rows = dataset.load_questions(cfg.train_data, tokenizer, cfg.max_prompt_tokens, "train_data", cfg.skip_bad,
                                        fmt.build_prompt)
    eval_rows = dataset.load_questions(cfg.eval_data, tokenizer, cfg.max_prompt_tokens, "eval_data",
                                       cfg.skip_bad, fmt.build_prompt)[:cfg.eval_limit or None] if cfg.eval_data else []
    demos, train_rows = coldstart.demonstrations(cfg, train_rows, search, fmt)
    if len(train_rows) < cfg.questions_per_step:
        raise cli.UserError(f"--train_data has {len(train_rows)} usable questions, fewer than "
                            f"--questions_per_step ({cfg.questions_per_step})")
    steps = cfg.steps or cfg.epochs * len(train_rows) // cfg.questions_per_step
    rundir.take_lock(run_dir, state, create=True)                      # (plan_run's, when --out_dir existed)
    if state.stale:
        log(f"{run_dir}: its lock was left by a run that ended without releasing it ({state.stale}); taken over")
    state.run_dir, state.created, state.steps = run_dir, not cfg.resume, steps
    info = rundir.create_run(cfg, run_dir, world, rank == 0)           # everything checked: the run folder
    log(f"{len(train_rows)} training questions, {len(eval_rows)} held-out, {len(demos)} demonstrations; "
        f"{steps} steps of {cfg.questions_per_step} questions × k={cfg.k}; {world} process(es) on {device}")

    policy, init_path, ref_path = _policy(cfg, base_path, demos, tokenizer, ckpts, rank, world, device, log, fmt)
    lora = settings.lora_settings(cfg)
    if lora:                                     # checkpoints record it (run_info.json): a resume needs that base
        info["lora_base"] = {"path": ref_path, "fingerprint": models.fingerprint(ref_path)}
    ref = None
    if cfg.kl_coef > 0 and lora:                 # the base model RL starts from: the policy with its adapters off
        ref = AdaptersOff(policy)
    elif cfg.kl_coef > 0:                        # frozen reference: the policy RL starts from (also on --resume)
        ref = unwrap(load_policy(ref_path, world, device, cfg.parallel, cfg.bf16, rank, packed=cfg.packed))
        ref.requires_grad_(False)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=device.type in ("cpu", "cuda"))   # one kernel: 3x the default loop on a CPU
    generator = watchdog.WatchedGenerator(make_generator(cfg, init_path, policy, tokenizer, rank, device,
                                                         stop_strings=fmt.stop_strings))
    parallel.on_close(generator.close)           # a vLLM engine shuts down before the process group is left
    watch = watchdog.Watchdog(rank, cfg.watchdog_min * 60)    # says what a rank that takes too long is doing
    watchdog.set_current(watch)
    parallel.on_close(watch.close)

    start_step = 0
    if cfg.resume:
        start_step = checkpoint.load(ckpts[-1], policy, optimizer, rank)
        log(f"resumed {run_dir} from {ckpts[-1].name} (step {start_step})")
        if rank == 0:                            # only now: a resume that fails before writes nothing
            rundir.record_resume(cfg, run_dir, info, start_step)
    if lora:                                     # the generator holds the base model: the adapters as they are now
        generator.update_weights(generator_weights(policy, merged=not generator.takes_adapter))
        log(lora_line(policy, lora, cfg, generator.takes_adapter))
    state.first_step = state.steps_done = start_step
    return Run(cfg, rank, world, device, run_dir, info, tokenizer, search, watchdog.WatchedTools(tool_runner),
               train_rows, eval_rows, steps, start_step, policy, ref, optimizer, generator,
               settings.tree_settings(cfg), rollout.Sampling(cfg.temperature, cfg.top_p),
               settings.loss_settings(cfg), settings.correction(cfg), scorer, log)


def run_score(cfg, score, fmt):
    """score(text, golds) -> reward.score_response's dict for this run: --strict_format, the format's tool tags, and
    --reward's function in place of the deep-research reward."""
    tags = {} if fmt.format_tags == tools.TAGS.format_tags else {"tool_names": fmt.format_tags}
    scored = functools.partial(score, strict_format=cfg.strict_format, **tags)
    return plugins.reward_function(cfg.reward, scored) if cfg.reward else scored


def _policy(cfg, base_path: str, demos: list[dict], tokenizer, ckpts: list[Path], rank: int, world: int, device,
            log, fmt=tools.TAGS) -> tuple[torch.nn.Module, str, str]:
    """(the policy, the model directory it was loaded from, the reference's): the latest checkpoint (--resume), a
    cached cold start, or the base model, cold-started first (D40) when demonstrations are given and none is cached.
    With LoRA the model is always the one RL starts from, with adapters (a resume's come from its checkpoint)."""
    cs_dir = config.cache_dir(cfg.cache_dir) / "cold_start" / coldstart.cold_start_key(base_path, demos, cfg, world) \
        if demos else None
    missing = bool(demos) and not (cs_dir / "config.json").exists() and not cfg.resume   # in this node's cache
    need_cold_start = bool(parallel.all_reduce_max(torch.tensor([int(missing)])).item())   # any node's: all ranks
    start_path = str(cs_dir) if demos else base_path                  # where RL starts (the reference)
    lora = settings.lora_settings(cfg)
    if cfg.resume:                          # a checkpoint damaged by hand or a full disk: one line, not a traceback
        models.check_model_dir(ckpts[-1], "--resume")
        if differ := models.architecture_differences(ckpts[-1], base_path, "--model's"):   # another model's, copied in
            raise cli.UserError(f"--resume: {ckpts[-1]} holds another model than --model {cfg.model}: "
                                + ", ".join(differ))
        if lora:                            # the adapters go back on the very model they were trained on
            start_path = recorded_base(ckpts[-1], start_path)
    init_path = str(ckpts[-1]) if cfg.resume and not lora else (base_path if need_cold_start else start_path)
    load = functools.partial(load_policy, world=world, device=device, parallel=cfg.parallel, bf16=cfg.bf16, rank=rank,
                             gradient_checkpointing=cfg.gradient_checkpointing, seed=cfg.seed, packed=cfg.packed)
    policy = load(init_path, lora=None if need_cold_start else lora, packed=cfg.packed and not need_cold_start)
    if need_cold_start:                          # (its forward padded, as --packed leaves the cold start)
        amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if cfg.bf16 else contextlib.nullcontext
        steps = settings.cold_start_settings(cfg).steps
        log(f"cold start: {len(demos)} demonstrations, {steps} steps (cached in {cs_dir})")
        coldstart.cold_start(policy, demos, tokenizer, cfg, rank, world, device, amp, log, fmt)
        checkpoint.export_model(policy, tokenizer, cs_dir, parallel.local_rank())   # into every node's cache
        init_path = str(cs_dir)
        del policy                               # RL's: the cold-started model as a cached run loads it (float32, so
        policy = load(init_path, lora=lora)      # the same weights), with LoRA's adapters, packed where it packs
    return policy, init_path, start_path


def recorded_base(ckpt: Path, start_path: str) -> str:
    """The base model a LoRA checkpoint's adapters were trained on, as its run_info.json records it (else, for a
    checkpoint from before that record, where the run would start now), checked to be there and unchanged."""
    import json
    try:
        base = json.loads((ckpt / "run_info.json").read_text(encoding="utf-8")).get("lora_base")
    except (OSError, ValueError, AttributeError):
        base = None
    path = base["path"] if base else start_path
    if not (Path(path) / "config.json").is_file() and Path(path).is_absolute():
        raise cli.UserError(f"--resume: this LoRA run's base model {path} is gone (its checkpoints hold the adapters "
                            f"only; {ckpt} holds the merged model)")
    if base and models.fingerprint(path) != base["fingerprint"]:
        raise cli.UserError(f"--resume: this LoRA run's base model {path} is not the one its adapters were trained on "
                            f"(its config or weight files changed); {ckpt} holds the merged model")
    return path


def lora_line(policy, lora, cfg, takes_adapter: bool) -> str:
    """The start-up line of a LoRA run: the adapters' size, the reference, what the generator receives at each sync."""
    lm = unwrap(policy).lm
    trainable = sum(p.numel() for p in trainable_parameters(policy))
    total = sum(p.numel() for p in lm.parameters())
    layers = len({n.split(".lora_A.")[0] for n, _ in lm.named_parameters() if ".lora_A." in n})
    sent = "the adapter's tensors" if takes_adapter else "the merged weights W + (α/r)·B·A (it cannot take an adapter)"
    reference = "; the KL reference is the model with its adapters off" if cfg.kl_coef > 0 else ""
    return (f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {layers} layers: {trainable:,} trainable parameters "
            f"({100 * trainable / total:.2f}% of {total:,}){reference}; the generator ({cfg.backend}) receives {sent} "
            "after each step")
