"""A run's directory and logs: the run folder, one line per step, metrics.jsonl, samples.jsonl, curves.png.

The metrics are the paper's quantities (reward, accuracy, token entropy, clipped fractions, tool calls, branching,
rollout diversity) as docs/reference.md defines them. Every rank contributes sums; one all-reduce turns them into means
over all ranks, and rank 0 writes. Also here: the settings a run records about itself and what a --resume may change.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness import checkpoint
from harness import cli
from harness import config
from harness import parallel
from harness import trees

# ---------------------------------------------------------------------------------------------------------------------
# The run directory


def resumed_run(cfg) -> Path:
    """The run --resume continues: <out_dir>/<run_name>, or the run under out_dir with the newest checkpoint."""
    out = Path(cfg.out_dir)
    if cfg.run_name:
        return out / cfg.run_name
    runs = sorted((p for p in out.glob("*") if checkpoint.checkpoint_dirs(p)),
                  key=lambda p: checkpoint.checkpoint_dirs(p)[-1].stat().st_mtime)
    if not runs:
        raise cli.UserError(f"--resume: no run with a checkpoint under {out}/ (give --out_dir or --run_name)")
    return runs[-1]


def plan_run(cfg) -> tuple[Path, list[Path]]:
    """(run directory, its checkpoints), creating nothing. A new run gets <out_dir>/<run_name or model-date-time>
    (rank 0's clock names it for every rank); --resume takes resumed_run(cfg), whose settings must match."""
    if cfg.resume:
        run_dir = resumed_run(cfg)
    else:
        name = cfg.run_name or parallel.broadcast(f"{Path(cfg.model).name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        run_dir = Path(cfg.out_dir) / name
    ckpts = checkpoint.checkpoint_dirs(run_dir)
    if cfg.resume and not ckpts:
        raise cli.UserError(f"--resume: no checkpoint in {run_dir}/checkpoints")
    if not cfg.resume and ckpts:
        raise cli.UserError(f"{run_dir} already has checkpoints: add --resume to continue it, or give another "
                               "--run_name")
    if cfg.resume:
        changes = config_changes(saved_config(run_dir), cfg)
        if changes and not cfg.allow_config_change:
            raise cli.UserError(f"--resume: settings differ from {run_dir}'s: " + "; ".join(changes) +
                                   " (use the run's values, or add --allow_config_change to resume with these)")
    return run_dir, ckpts


def saved_config(run_dir: Path) -> dict:
    """The settings the run last started with: the newest document of config_history.yaml, else config.yaml."""
    import yaml
    history = run_dir / "config_history.yaml"
    if history.exists():
        return [doc for doc in yaml.safe_load_all(history.read_text()) if doc][-1]
    return yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}


def create_run(cfg, run_dir: Path, world: int, master: bool) -> dict:
    """Rank 0 writes the run's config.yaml and run_info.json (a new run) or appends this start's settings to
    config_history.yaml (a resumed run: config.yaml keeps the first start's). Returns the run info."""
    info = run_info(world)
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        text = config_yaml(cfg)
        print(text, flush=True)
        if cfg.resume:
            with open(run_dir / "config_history.yaml", "a") as f:
                f.write(f"--- # resumed {info['started']}, git {info['git_commit']}\n" + text)
        else:
            (run_dir / "config.yaml").write_text(text)
            (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    parallel.barrier()
    return info


def trim_logs(run_dir: Path, step: int) -> None:
    """On resume: drop the lines metrics.jsonl, samples.jsonl and trees.jsonl got after the checkpoint of `step`, and
    a last line torn by a crash or Ctrl-C mid-write."""
    for name in ("metrics.jsonl", "samples.jsonl", "trees.jsonl"):
        path = run_dir / name
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
            path.write_text("".join(line + "\n" for line in kept))


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")                      # a torn line: dropped


class RunState:
    """How far the run got, for the line a stopped run prints: the run folder, whether this start created it, the
    steps finished and the checkpoints. A new run stopped before its first step leaves no folder."""

    def __init__(self):
        self.run_dir, self.created, self.first_step, self.steps_done, self.steps = None, False, 0, 0, 0
        self.tools = None                        # the run's tools.Tools, closed however the run ends

    def stop(self, cfg, rank: int, world: int) -> str:
        """After an interrupt or a failure: rank 0 removes the folder of a new run that finished no step. Returns
        the one line saying what was kept and how to continue."""
        if self.run_dir is None or not (self.run_dir.exists() or self.created):
            return "nothing was written"
        if self.steps_done == self.first_step:
            if self.created and not checkpoint.checkpoint_dirs(self.run_dir):
                if rank == 0:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                return f"no training step was finished, so {self.run_dir} was removed (nothing to keep)"
            return f"no new step was finished; {self.run_dir} is as it was"
        ckpts = checkpoint.checkpoint_dirs(self.run_dir)
        kept = f"{self.run_dir} keeps the logs of steps 1-{self.steps_done}"
        if not ckpts:
            return (f"stopped after step {self.steps_done}/{self.steps}: {kept} but no checkpoint yet (--save_every "
                    f"{cfg.save_every}), so it cannot be resumed")
        redo = self.steps_done - int(ckpts[-1].name.split("_")[-1])
        launch = "python train.py" if world == 1 else "your torchrun command with"
        where = f" --out_dir {cfg.out_dir}" if cfg.out_dir != config.Config().out_dir else ""
        return (f"stopped after step {self.steps_done}/{self.steps}: {kept} and checkpoint {ckpts[-1].name}"
                + (f" ({redo} step(s) after it will run again)" if redo else "") +
                f"; continue with: {launch} --resume true --run_name {self.run_dir.name}{where}")


# ---------------------------------------------------------------------------------------------------------------------
# One line per step on rank 0, metrics.jsonl, samples.jsonl, optional TensorBoard / W&B, a PNG at the end


LINE = [("reward", "reward", "{:.3f}"), ("acc", "acc", "{:.2f}"), ("entropy", "entropy", "{:.2f}"),
        ("clip_hi", "clip_hi", "{:.3f}"), ("clip_lo", "clip_lo", "{:.3f}"), ("preserved", "preserved", "{:.3f}"),
        ("m", "m", "{:.1f}"), ("branches", "branches", "{:.1f}"), ("tool_calls", "tool_calls", "{:.1f}"),
        ("resp_len", "resp_len", "{:.0f}")]

# what each rank sums, and what the sum is divided by to give the logged mean (docs/reference.md defines each)
PER_TRAJECTORY = ("reward", "acc", "f1", "format_ok", "tool_calls", "resp_len", "seq_len", "gen_len", "truncated",
                  "adv_nonzero")
PER_QUESTION = ("m", "branches")
PER_TOKEN = ("clip_hi", "clip_lo", "clip_dual", "preserved", "approx_kl", "ratio", "kl_ref", "out_hi", "out_lo",
             "grad_kept", "grad_dropped")
PER_OPTIMISER_STEP = ("pg_loss", "kl_loss", "entropy_loss")


@dataclass
class StepBatch:
    """What one step rolled out on this rank, for the logs: the questions, the trajectories (ordered by question),
    the score of each (reward.score_response) and its reward (the score's, plus DAPO's overlong penalty), m per
    question."""
    rows: list[dict]
    trajectories: list
    scores: list[dict]
    rewards: torch.Tensor
    m_per_question: list


def step_metrics(step: int, batch: StepBatch, tree: dict, adv, entropy, losses: dict, grad_norms: list[float]) -> dict:
    """This rank's sums and counts -> one all-reduce -> the step's means over all ranks. tree: rollout.tree_stats of
    the trained batch; adv: (N, W) per-token advantages; entropy: the global [count, ΣH, ΣH²] of the old policy's
    token entropy (already summed over ranks); losses: loss.policy_loss's metrics summed over the step's calls."""
    import advantage
    scores = batch.scores
    local = {key: float(tree[key]) for key in ("trajectories", "questions", "tool_calls", "resp_len", "seq_len",
                                               "gen_len", "truncated", "m", "branches", "branch_top_chain",
                                               "trees_branched")}
    local.update({key: float(v) for key, v in tree.items() if key.startswith("tools/")})
    local.update({key: float(v) for key, v in losses.items()})
    local.update({"reward": float(batch.rewards.sum()), "acc": sum(s["em"] for s in scores),
                  "f1": sum(s["f1"] for s in scores), "format_ok": sum(s["format_valid"] for s in scores),
                  "adv_nonzero": float((adv != 0).any(1).sum())})
    local.update({f"diversity/{key}": v for key, v in trees.diversity(batch.trajectories, scores).items()})
    g = parallel.reduce_metrics(local)
    n_tok, n_opt = max(1.0, g["n_tokens"]), len(grad_norms)
    mean_h, std_h = advantage.mean_std(entropy)
    m = {"step": step, "trajectories": g["trajectories"]}
    m.update({key: g[key] / g["trajectories"] for key in PER_TRAJECTORY})
    m.update({key: g[key] / g["questions"] for key in PER_QUESTION})
    m.update({key: g[key] / n_tok for key in PER_TOKEN})
    m.update({key: g[key] / n_opt for key in PER_OPTIMISER_STEP})
    m.update({"branch_top_chain": g["branch_top_chain"] / g["trees_branched"] if g["trees_branched"] else 0.0,
              "entropy": mean_h, "entropy_std": std_h, "n_valid_tokens": float(entropy[0]),
              "grad_norm": sum(grad_norms) / n_opt})
    m.update({key: g[key] / g["questions"] for key in sorted(g) if key.startswith("diversity/")})
    m.update({key: v for key, v in g.items() if key.startswith("tools/")})
    return m


class RolloutProgress:
    """tree_rollout's `progress`: the postfix of a tqdm bar, moving while a rollout generates: the round, the
    trajectories finished and the tokens decoded so far (`on_step`, which the transformers backend calls after every
    decoding step; redrawn at most twice a second). count=True also advances the bar by the trajectories finished."""

    def __init__(self, bar, what: str = "rollout", count: bool = False):
        self.bar, self.what, self.count = bar, what, count
        self.round, self.finished, self.done, self.tokens, self.shown = 0, "", 0, 0, 0.0

    def __call__(self, rounds_done: int, finished: int, total: int) -> None:
        self.round, self.finished = rounds_done, f"{finished}/{total} trajectories finished, "
        if self.count:
            self.bar.update(finished - self.done)
            self.done = finished
        self.show(force=True)

    def on_step(self, rows: int) -> None:
        self.tokens += rows
        self.show()

    def show(self, force: bool = False) -> None:
        if force or time.time() - self.shown > 0.5:
            self.bar.set_postfix_str(f"{self.what} round {self.round + 1}: {self.finished}{self.tokens:,} tokens")
            self.shown = time.time()


def eval_line(summary: dict) -> str:
    return (f"Pass@1 {summary['pass@1']:.3f} | EM {summary['em']:.3f} | F1 {summary['f1']:.3f} | "
            f"reward {summary['reward']:.3f} | format ok {summary['format_valid']:.2f} | "
            f"tool calls {summary['tool_calls']:.2f} | {summary['wall_s']:.0f}s")


def saved_eval(run_dir: Path, name: str) -> dict | None:
    """The summary an earlier part of a resumed run wrote for evaluation `name`, if any."""
    path = run_dir / "eval" / f"{name}_summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def format_line(step: int, steps: int, m: dict) -> str:
    parts = [f"step {step}/{steps}"] + [f"{label} {fmt.format(m[key])}" for label, key, fmt in LINE]
    parts += [f"{tool} errors {errors}/{calls}" for tool, errors, calls in failing_tools(m)]
    return " | ".join(parts) + f" | rollout {m['time/rollout']:.1f}s old_logp {m['time/old_logp']:.1f}s " \
                               f"update {m['time/update']:.1f}s"


def failing_tools(m: dict) -> list[tuple[str, int, int]]:
    """(tool, errors, calls) of every tool that failed on more than half of the step's calls (all ranks)."""
    out = []
    for tool in ("search", "python"):
        calls, errors = int(m.get(f"tools/{tool}/calls", 0)), int(m.get(f"tools/{tool}/errors", 0))
        if calls and errors > calls / 2:
            out.append((tool, errors, calls))
    return out


def last_error(trajectories, tool: str) -> str:
    """The last `Error: ...` observation a call of `tool` got in these trajectories (this rank's), or ''."""
    found = ""
    for t in trajectories:
        for (name, _), text in zip(t.tool_calls, t.observations):
            if name == tool and text.startswith("Error:"):
                found = text
    return " ".join(found.split())[:300]


def log_step(run_dir: Path, metrics: dict, batch: StepBatch, steps: int, n_samples: int, search, log) -> None:
    """Rank 0, after a step: metrics.jsonl, samples.jsonl, trees.jsonl (every rank's trees, gathered by the caller in
    batch order), the step line and a warning per failing tool."""
    write_step(run_dir, metrics, batch, n_samples)
    log(format_line(metrics["step"], steps, metrics))
    for tool, errors, calls in failing_tools(metrics):
        backend = repr(search) if tool == "search" else "the python sandbox"
        log(f"warning: {tool} failed on {errors} of {calls} calls this step ({backend}); last error: "
            f"{last_error(batch.trajectories, tool) or 'on another rank'}")


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


class Trackers:
    """TensorBoard (<run>/tb) and Weights & Biases, each only when switched on (rank 0)."""

    def __init__(self, cfg, run_dir: Path, master: bool):
        self.writers = []
        if master and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writers.append(SummaryWriter(str(run_dir / "tb")))
        if master and cfg.wandb:
            import wandb
            self.writers.append(wandb.init(project=cfg.wandb_project, name=run_dir.name,
                                           config=dataclasses.asdict(cfg), resume="allow"))

    def log(self, m: dict, step: int) -> None:
        for writer in self.writers:              # a TensorBoard SummaryWriter or a W&B run
            if hasattr(writer, "add_scalar"):
                for key, v in m.items():
                    writer.add_scalar(key, v, step)
            else:
                writer.log(m, step=step)

    def close(self) -> None:
        for writer in self.writers:
            (getattr(writer, "close", None) or getattr(writer, "finish"))()


def write_step(run_dir: Path, m: dict, batch: StepBatch, n_samples: int) -> None:
    """Append the step's metrics to metrics.jsonl and its first n_samples trajectories (full text) to
    samples.jsonl."""
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(m) + "\n")
    with open(run_dir / "samples.jsonl", "a") as f:
        for t, s, r in list(zip(batch.trajectories, batch.scores, batch.rewards.tolist()))[:n_samples]:
            row = batch.rows[t.group_id]
            f.write(json.dumps({"step": m["step"], "question": row["question"], "golds": row["golds"],
                                "traj_id": t.traj_id, "parent": t.parent, "reward": r, "em": s["em"],
                                "text": t.text}, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# What a run records about itself: its settings (and what a --resume may change), git commit and versions


# settings a resumed run may change: length, evaluation, logging, output, and how (not what) it computes
RESUMABLE = {"steps", "epochs", "eval_data", "eval_limit", "eval_n", "eval_every", "eval_before", "eval_temperature",
             "eval_top_p", "log_samples", "tensorboard", "wandb", "wandb_project", "out_dir", "run_name", "resume",
             "save_every", "keep_checkpoints", "save_trainer_state", "device", "dist_timeout_min", "cache_dir",
             "micro_batch_size", "gen_batch_size", "logp_chunk_size", "gradient_checkpointing", "parallel",
             "backend", "vllm_gpu_memory_utilization", "allow_config_change"}


def config_changes(saved: dict, cfg: config.Config) -> list[str]:
    """`name: saved -> now` for every setting outside RESUMABLE that differs from the run's saved config."""
    now = dataclasses.asdict(cfg)
    return [f"{key}: {saved.get(key)!r} -> {now[key]!r}" for key in now
            if key not in RESUMABLE and saved.get(key, now[key]) != now[key]]


def config_yaml(cfg: config.Config) -> str:
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
