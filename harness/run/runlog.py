"""A run's logs: one line per step, metrics.jsonl, samples.jsonl, curves.png, TensorBoard / W&B, the mismatch watch.

The metrics are the paper's quantities (reward, accuracy, token entropy, clipped fractions, tool calls, branching,
rollout diversity) as docs/reference.md defines them. Every rank contributes sums; one all-reduce turns them into means
over all ranks, and rank 0 writes. The run folder and the settings a run records about itself are harness/run/rundir.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import tools
from harness.run import parallel
from harness import jsonl, memory, trees

# ---------------------------------------------------------------------------------------------------------------------
# One line per step on rank 0, metrics.jsonl, samples.jsonl, optional TensorBoard / W&B, a PNG at the end


LINE = [("reward", "reward", "{:.3f}"), ("acc", "acc", "{:.2f}"), ("entropy", "entropy", "{:.2f}"),
        ("clip_hi", "clip_hi", "{:.3f}"), ("clip_lo", "clip_lo", "{:.3f}"), ("preserved", "preserved", "{:.3f}"),
        ("m", "m", "{:.1f}"), ("branches", "branches", "{:.1f}"), ("tool_calls", "tool_calls", "{:.1f}"),
        ("resp_len", "resp_len", "{:.0f}"), ("zero_std", "frac_reward_zero_std", "{:.2f}"),
        ("mismatch", "mismatch/k3", "{:.1e}")]

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


def step_metrics(step: int, batch: StepBatch, tree_stats: dict, adv, entropy, losses: dict,
                 grad_norms: list[float]) -> dict:
    """This rank's sums and counts -> one all-reduce -> the step's means over all ranks. tree_stats:
    rollout.tree_stats of the trained batch; adv: (N, W) per-token advantages; entropy: the global [count, ΣH, ΣH²] of the old policy's
    token entropy (already summed over ranks); losses: loss.policy_loss's metrics summed over the step's calls."""
    import advantage
    scores = batch.scores
    local = {key: float(tree_stats[key]) for key in ("trajectories", "questions", "tool_calls", "resp_len", "seq_len",
                                               "gen_len", "truncated", "m", "branches", "branch_top_chain",
                                               "trees_branched", "deadline_hits", "gen_idle_s")}
    local.update({key: float(v) for key, v in tree_stats.items() if key.startswith("tools/")})
    local["ranks"] = 1.0
    local.update({key: float(v) for key, v in losses.items()})
    local.update({"reward": float(batch.rewards.sum()), "acc": sum(s["em"] for s in scores),
                  "f1": sum(s["f1"] for s in scores), "format_ok": sum(s["format_valid"] for s in scores),
                  "adv_nonzero": float((adv != 0).any(1).sum())})
    local.update({f"diversity/{key}": v for key, v in trees.diversity(batch.trajectories, scores).items()})
    local.update(group_sums(batch))
    g = parallel.reduce_metrics(local)
    n_tok, n_opt = max(1.0, g["n_tokens"]), len(grad_norms)
    mean_h, std_h = advantage.mean_std(entropy)
    out = {"step": step, "trajectories": g["trajectories"]}
    out.update({key: g[key] / g["trajectories"] for key in PER_TRAJECTORY})
    out.update({key: g[key] / g["questions"] for key in PER_QUESTION})
    out.update({key: g[key] / n_tok for key in PER_TOKEN})
    out.update({key: g[key] / n_opt for key in PER_OPTIMISER_STEP})
    out.update({"branch_top_chain": g["branch_top_chain"] / g["trees_branched"] if g["trees_branched"] else 0.0,
              "entropy": mean_h, "entropy_std": std_h, "n_valid_tokens": float(entropy[0]),
              "deadline_hits": g["deadline_hits"], "time/gen_idle": g["gen_idle_s"] / g["ranks"],
              "grad_norm": sum(grad_norms) / n_opt})
    out.update({key: g[key] / g["questions"] for key in sorted(g) if key.startswith("diversity/")})
    out.update({key: v for key, v in g.items() if key.startswith("tools/")})
    out.update(group_means(g))
    return out


def group_sums(batch: StepBatch) -> dict[str, float]:
    """This rank's sums behind `frac_reward_zero_std` (the share of questions whose rewards are all equal, so that
    their advantages are 0 and they teach nothing) and, per question type (a dataset's `type` field), the same
    with the trajectories' success, searches and truncation, and the branches and the pre-monitor's m per question:
    docs/reference.md, the metrics."""
    members: dict[int, list] = {}
    for t, s, r in zip(batch.trajectories, batch.scores, batch.rewards.tolist()):
        members.setdefault(t.group_id, []).append((t, s, r))
    sums: dict[str, float] = {"groups": 0.0, "groups_zero_std": 0.0}
    for g, group in members.items():
        rewards = [r for _, _, r in group]
        zero_std = float(max(rewards) - min(rewards) < 1e-6)
        sums["groups"] += 1
        sums["groups_zero_std"] += zero_std
        kind = batch.rows[g]["meta"].get("type")
        if not isinstance(kind, str) or not kind.strip():
            continue
        kind = kind.strip().replace("/", "_")        # one level of the metric's name
        per = {"groups": 1.0, "groups_zero_std": zero_std, "trajectories": len(group),
               "acc": sum(s["em"] for _, s, _ in group),
               "searches": sum(name == "search" for t, _, _ in group for name, _ in t.tool_calls),
               "truncated": sum(bool(t.truncated) for t, _, _ in group),
               "branches": sum(t.parent is not None for t, _, _ in group), "m": float(batch.m_per_question[g])}
        for key, value in per.items():
            sums[f"type/{kind}/{key}"] = sums.get(f"type/{kind}/{key}", 0.0) + float(value)
    return sums


def group_means(g: dict[str, float]) -> dict[str, float]:
    """group_sums summed over ranks -> the logged means (`type/<type>/acc` is per trajectory of that type)."""
    out = {"frac_reward_zero_std": g["groups_zero_std"] / g["groups"] if g.get("groups") else 0.0}
    for kind in sorted({key.split("/")[1] for key in g if key.startswith("type/")}):
        at = f"type/{kind}/"
        out[at + "questions"] = g[at + "groups"]
        out[at + "frac_reward_zero_std"] = g[at + "groups_zero_std"] / g[at + "groups"]
        out.update({at + key: g[at + key] / g[at + "trajectories"] for key in ("acc", "searches", "truncated")})
        out.update({at + key: g[at + key] / g[at + "groups"] for key in ("branches", "m")})
    return out


class MismatchWatch:
    """A one-line warning when the mismatch of a step, the first rollout after a weight sync, is far above its running
    level (the median of the last 8 steps): a generator sampling with stale or half-loaded weights; or when some
    trajectories' generator log-probs did not fit their responses (a generator bug)."""

    def __init__(self, factor: float = 10.0, floor: float = 1e-3):
        self.factor, self.floor, self.history = factor, floor, []

    def check(self, step: int, m: dict) -> str:
        if misfit := m.get("mismatch/misfit_rows"):
            return (f"warning: step {step}: {misfit:.0f} trajectories' generator log-probs had another length than "
                    f"their responses (a generator bug): their tokens count as having none (weight 1 in the "
                    f"correction, left out of the mismatch metrics; mismatch/misfit_rows)")
        k3 = m.get("mismatch/k3")
        if k3 is None:
            return ""
        recent = sorted(self.history[-8:])
        self.history.append(k3)
        level = recent[len(recent) // 2] if recent else None
        if level is None or k3 <= max(self.factor * level, self.floor):
            return ""
        return (f"warning: step {step}: mismatch/k3 {k3:.2e} is {k3 / max(level, 1e-12):.0f}x its running level "
                f"{level:.2e}: the generator may be sampling with stale or half-loaded weights (the weight sync)")


class Clock:
    """Wall-clock seconds and peak resident memory of a step's phases: `with clock("update"): ...` adds the block's
    time to seconds["update"] and keeps the process's peak memory during it in peaks["update"] (harness/memory.py),
    then hands the memory the phase freed back to the system; `metrics` gives the step's time/* and memory/* metrics."""

    def __init__(self):
        self.start, self.seconds, self.peaks = time.time(), {}, {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.time()
        memory.reset_peak()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.time() - start
            peak = memory.peak_gb()
            if peak is not None:
                self.peaks[phase] = max(peak, self.peaks.get(phase, 0.0))
            memory.release()

    def metrics(self, rollout_seconds: list[float], update_tokens: float) -> dict:
        """time/<phase> for each phase, the whole step, the slowest rank's rollout and its ratio to the ranks' mean
        (rollout_seconds: every rank's, parallel.gather), and the update's throughput (update_tokens: the loss
        tokens of every rank, times the epochs); memory/<phase>: this rank's peak resident GB in the phase."""
        out = {f"time/{phase}": seconds for phase, seconds in self.seconds.items()}
        slowest, mean = max(rollout_seconds), sum(rollout_seconds) / len(rollout_seconds)
        out.update({"time/rollout_slowest": slowest, "time/rollout_imbalance": slowest / max(1e-9, mean),
                    "time/step": time.time() - self.start,
                    "update_tokens_per_s": update_tokens / max(self.seconds.get("update", 0.0), 1e-9)})
        out.update({f"memory/{phase}": gb for phase, gb in self.peaks.items()})
        return out


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
            f"tool calls {summary['tool_calls']:.2f} | {summary['wall_s']:.0f}s" +
            "".join(f" | {kind} Pass@1 {s['pass@1']:.3f}" for kind, s in summary.get("by_type", {}).items()))


def saved_eval(run_dir: Path, name: str) -> dict | None:
    """The summary an earlier part of a resumed run wrote for evaluation `name`, if that evaluation finished (its
    summary.md, written last, is there and its summary.json reads: a run killed while writing them has none)."""
    path = run_dir / "eval" / f"{name}_summary.json"
    if not (run_dir / "eval" / f"{name}_summary.md").exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def format_line(step: int, steps: int, m: dict) -> str:
    parts = [f"step {step}/{steps}"] + [f"{label} {fmt.format(m[key])}" for label, key, fmt in LINE if key in m]
    parts += [f"acc {key.split('/')[1]} {m[key]:.2f}" for key in sorted(m) if key.startswith("type/")
              and key.endswith("/acc")]
    parts += [f"{tool} errors {errors}/{calls}" for tool, errors, calls in failing_tools(m)]
    slowest = f" (slowest rank {m['time/rollout_slowest']:.1f}s, {m['time/rollout_imbalance']:.2f}x the mean)" \
        if m.get("time/rollout_imbalance", 1.0) > 1.05 else ""
    return " | ".join(parts) + f" | rollout {m['time/rollout']:.1f}s{slowest} old_logp {m['time/old_logp']:.1f}s " \
                               f"update {m['time/update'] + m.get('time/sync', 0.0):.1f}s"


def failing_tools(m: dict) -> list[tuple[str, int, int]]:
    """(tool, errors, calls) of every tool that failed on more than half of the step's calls (all ranks)."""
    out = []
    for tool in sorted({key.split("/")[1] for key in m if key.startswith("tools/") and key.endswith("/calls")} -
                       {"invalid"}):
        calls, errors = int(m.get(f"tools/{tool}/calls", 0)), int(m.get(f"tools/{tool}/errors", 0))
        if calls and errors > calls / 2:
            out.append((tool, errors, calls))
    return out


def last_error(trajectories, tool: str) -> str:
    """The last `Error: ...` observation a call of `tool` got in these trajectories (this rank's), or '', as one
    console line: no control character, escape sequence, line end or bidirectional control reaches the terminal."""
    from harness.cli import for_console
    found = ""
    for t in trajectories:
        for (name, _), text in zip(t.tool_calls, t.observations):
            if name == tool and text.startswith("Error:"):
                found = text
    return " ".join(for_console(tools.as_data(found)).split())[:300]


def log_step(run_dir: Path, metrics: dict, batch: StepBatch, steps: int, n_samples: int, search, log) -> None:
    """Rank 0, after a step: metrics.jsonl, samples.jsonl, trees.jsonl (every rank's trees, gathered by the caller in
    batch order), the step line and a warning per failing tool."""
    write_step(run_dir, metrics, batch, n_samples)
    log(format_line(metrics["step"], steps, metrics))
    for tool, errors, calls in failing_tools(metrics):
        backend = f" ({search!r})" if tool == "search" else " (the python sandbox)" if tool == "python" else ""
        log(f"warning: {tool} failed on {errors} of {calls} calls this step{backend}; last error: "
            f"{last_error(batch.trajectories, tool) or 'on another rank'}")


def plot_curves(metrics_path: Path, out_png: Path, evals: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in jsonl.lines(metrics_path.read_text(encoding="utf-8")) if line.strip()]
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
    """TensorBoard (<run>/tb) and Weights & Biases, each only when --report_to names it (rank 0)."""

    def __init__(self, cfg, run_dir: Path, master: bool):
        self.writers = []
        if master and "tensorboard" in cfg.report_to:
            from torch.utils.tensorboard import SummaryWriter
            self.writers.append(SummaryWriter(str(run_dir / "tb")))
        if master and "wandb" in cfg.report_to:
            import os

            import wandb
            self.writers.append(wandb.init(project=os.environ.get("WANDB_PROJECT", "aepo"), name=run_dir.name,
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
