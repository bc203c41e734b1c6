"""GRPO vs ARPO vs AEPO at small scale: same model, data, budget and seeds; only the SPEC switches differ.

    python bench/compare_algorithms.py                          # 3 algorithms x 3 seeds, 1 h 49 min on 2 CPU cores
    python bench/compare_algorithms.py --seeds 0,1,2,3,4 --jobs 1 --threads 2
    python bench/compare_algorithms.py --report_only            # re-aggregate finished runs

Task: bench/lookup_task.py (fictional people and firms behind the BM25 search tool; one- and two-search
questions). Model: the embedded SmolLM2-135M-Instruct, cold-started once per seed on the same 24 demonstrations,
so the three algorithms of a seed start from the same weights (the held-out "before" score is measured once per
seed, in its GRPO run). Configurations, as configs/{grpo,arpo,aepo}.yaml:

    GRPO  entropy_branching=False, sg_clip=False, entropy_advantage=False      (k independent samples)
    ARPO  entropy_branching=True, dynamic_budget=False, lam=0, sg_clip=False, entropy_advantage=False
    AEPO  all switches on (dynamic budget, branch penalty, stop-gradient clip, entropy-aware advantage)

Runs go to --work (one train.py process each, `--jobs` at a time with `--threads` torch threads each; a finished
run is reused, an unfinished one is started again). The report (results.md, results.json, compare_algorithms.png)
goes to --out. Every seed that ran is reported; none is dropped.
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from lookup_task import make_task  # noqa: E402

ALGOS = ("grpo", "arpo", "aepo")
COLORS = {"grpo": "tab:gray", "arpo": "tab:blue", "aepo": "tab:red"}
CURVES = [("reward", "training reward"), ("entropy", "policy token entropy"), ("clip_hi", "upper-clipped token share"),
          ("preserved", "clipped but kept (sg clip) share"), ("branches", "branches per tree"),
          ("branch_top_chain", "branch share on the top chain"), ("tool_calls", "tool calls per trajectory")]


def train_argv(algo: str, seed: int, task: dict, args) -> list[str]:
    """The exact train.py command line of one run (printed in the report)."""
    return ["train.py", "--config", f"configs/{algo}.yaml", f"--seed={seed}", f"--run_name={algo}-s{seed}",
            f"--out_dir={args.work}/runs", f"--train_data={task['train']}", f"--eval_data={task['test']}",
            "--search_kw", json.dumps({"corpus_path": task["corpus"], "topk": 1}),
            f"--steps={args.steps}", f"--k={args.k}", f"--questions_per_step={args.questions_per_step}",
            f"--max_response_tokens={args.max_response_tokens}", f"--lr={args.lr}",
            f"--eval_limit={args.eval_limit}", f"--eval_n={args.eval_n}",
            f"--eval_before={str(algo == 'grpo').lower()}",
            "--save_every=0", "--keep_checkpoints=1"]


def run_one(algo: str, seed: int, task: dict, args) -> str:
    run_dir = Path(args.work) / "runs" / f"{algo}-s{seed}"
    argv = train_argv(algo, seed, task, args)
    log = Path(args.work) / "logs" / f"{algo}-s{seed}.log"
    argv_file = log.with_suffix(".argv.json")
    if (run_dir / "eval" / "after_summary.json").exists():
        if not argv_file.exists() or json.loads(argv_file.read_text()) != argv:
            raise RuntimeError(f"{run_dir} finished with other settings than these; pass another --work or "
                               "delete it")
        return f"{algo}-s{seed}: done before, reused"
    shutil.rmtree(run_dir, ignore_errors=True)                 # an unfinished run starts again
    log.parent.mkdir(parents=True, exist_ok=True)
    argv_file.write_text(json.dumps(argv))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{algo}-s{seed}: train.py exited {proc.returncode}; see {log}")
    return f"{algo}-s{seed}: {time.time() - t0:.0f} s"


def load_run(run_dir: Path) -> dict:
    if not (run_dir / "metrics.jsonl").exists() or not (run_dir / "eval" / "after_summary.json").exists():
        raise FileNotFoundError(f"{run_dir.name}: no finished run in {run_dir} (run without --report_only)")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ev = {name: json.loads(p.read_text()) for name in ("before", "after")
          if (p := run_dir / "eval" / f"{name}_summary.json").exists()}
    return {"metrics": rows, "eval": ev}


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def report(args, seeds: list[int], task: dict) -> dict:
    runs = {(a, s): load_run(Path(args.work) / "runs" / f"{a}-s{s}") for a in ALGOS for s in seeds}
    k = args.eval_n
    res = {"seeds": seeds, "settings": {key: getattr(args, key) for key in
                                        ("steps", "k", "questions_per_step", "max_response_tokens", "lr",
                                         "eval_limit", "eval_n")},
           "command": f"python bench/compare_algorithms.py --seeds {','.join(map(str, seeds))}",
           "train_command_example": "python " + shlex.join(train_argv("aepo", seeds[0], task, args)).replace(
               f"{ROOT}/", ""),
           "before": {s: {m: runs["grpo", s]["eval"]["before"][m] for m in ("pass@1", f"pass@{k}", "f1")}
                      for s in seeds},
           "algos": {}}
    for a in ALGOS:
        per_seed = {}
        for s in seeds:
            r, after = runs[a, s], runs[a, s]["eval"]["after"]
            ms = r["metrics"]
            half = ms[len(ms) // 2:]

            def avg(key, rows=ms):
                return statistics.fmean(m[key] for m in rows)
            branched = [m["branch_top_chain"] for m in ms if m["branches"] > 0]
            per_seed[s] = {"pass@1": after["pass@1"], f"pass@{k}": after[f"pass@{k}"], "f1": after["f1"],
                           "eval_tool_calls": after["tool_calls"],
                           "train_reward_2nd_half": avg("reward", half), "entropy_first": ms[0]["entropy"],
                           "entropy_last_3": avg("entropy", ms[-3:]), "entropy_mean": avg("entropy"),
                           "clip_hi": avg("clip_hi"), "preserved": avg("preserved"), "branches": avg("branches"),
                           "branch_top_chain": statistics.fmean(branched) if branched else None,
                           "tool_calls": avg("tool_calls"),
                           "searches_executed": sum(m["tools/search/calls"] for m in ms),
                           "step_s": avg("time/step")}
        summary = {}
        for key in per_seed[seeds[0]]:
            vals = [per_seed[s][key] for s in seeds if per_seed[s][key] is not None]
            summary[key] = mean_sd(vals) if vals else None
        res["algos"][a] = {"per_seed": per_seed, "mean_sd": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    table = markdown(res, k)
    (out / "results.md").write_text(table)
    plot(runs, res, seeds, k, out / "compare_algorithms.png")
    print(table)
    return res


def markdown(res: dict, k: int) -> str:
    seeds = res["seeds"]
    before = [res["before"][s]["pass@1"] for s in seeds]
    before_k = [res["before"][s][f"pass@{k}"] for s in seeds]
    lines = [f"Held-out Pass@1 / Pass@{k} (mean ± sd over seeds {', '.join(map(str, seeds))}; per-seed values in "
             f"brackets). Start (cold start, shared by the three algorithms of a seed): Pass@1 "
             f"{mean_sd(before)[0]:.3f} ± {mean_sd(before)[1]:.3f} "
             f"[{', '.join(f'{v:.3f}' for v in before)}], "
             f"Pass@{k} {mean_sd(before_k)[0]:.3f} ± {mean_sd(before_k)[1]:.3f}.", "",
             f"| | Pass@1 after | Pass@{k} after | train reward (2nd half) | entropy step 1 → last 3 "
             "| upper-clip share | kept by sg clip | branches / tree | top-chain share | tool calls / traj | searches run | s / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(a, key, fmt="{:.3f}", seeds_too=False):
        v = res["algos"][a]["mean_sd"][key]
        if v is None:
            return "—"
        text = f"{fmt.format(v[0])} ± {fmt.format(v[1])}"
        if seeds_too:
            text += " [" + ", ".join(fmt.format(res["algos"][a]["per_seed"][s][key]) for s in seeds) + "]"
        return text
    for a in ALGOS:
        lines.append(f"| {a.upper()} | {cell(a, 'pass@1', seeds_too=True)} | {cell(a, f'pass@{k}', seeds_too=True)} "
                     f"| {cell(a, 'train_reward_2nd_half')} | {cell(a, 'entropy_first', '{:.2f}')} → "
                     f"{cell(a, 'entropy_last_3', '{:.2f}')} | {cell(a, 'clip_hi', '{:.4f}')} "
                     f"| {cell(a, 'preserved', '{:.4f}')} | {cell(a, 'branches', '{:.2f}')} "
                     f"| {cell(a, 'branch_top_chain', '{:.2f}')} | {cell(a, 'tool_calls', '{:.2f}')} "
                     f"| {cell(a, 'searches_executed', '{:.0f}')} | {cell(a, 'step_s', '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, res: dict, seeds: list[int], k: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for a in ALGOS:
            if key.startswith("branch") and a == "grpo":          # GRPO never branches
                continue
            # steps without any branch have no top-chain share: NaN, left out of the means
            vals = np.array([[m[key] if key != "branch_top_chain" or m["branches"] > 0 else np.nan
                              for m in runs[a, s]["metrics"]] for s in seeds], dtype=float)
            steps = np.arange(1, vals.shape[1] + 1)
            with warnings.catch_warnings():                       # all-NaN columns stay NaN (a gap in the curve)
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, lo, hi = (running_mean(f(vals, axis=0), 3) for f in (np.nanmean, np.nanmin, np.nanmax))
            ax.plot(steps, mean, color=COLORS[a], label=a.upper())
            ax.fill_between(steps, lo, hi, color=COLORS[a], alpha=0.12)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    ax = axes.flat[-1]                                          # held-out Pass@1 per seed, before and after
    ax.axhline(statistics.fmean(res["before"][s]["pass@1"] for s in seeds), color="black", ls="--", lw=1,
               label="start (mean)")
    for i, a in enumerate(ALGOS):
        vals = [res["algos"][a]["per_seed"][s]["pass@1"] for s in seeds]
        ax.bar(i, statistics.fmean(vals), color=COLORS[a], alpha=0.5)
        ax.scatter([i] * len(vals), vals, color=COLORS[a], zorder=3, s=18)
    ax.set_xticks(range(len(ALGOS)), [a.upper() for a in ALGOS])
    ax.set_title("held-out Pass@1 after training (dots: seeds)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"GRPO vs ARPO vs AEPO on the lookup task, SmolLM2-135M, seeds {', '.join(map(str, seeds))} "
                 f"(curves: mean over seeds, 3-step running mean; band: min-max over seeds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def running_mean(xs: np.ndarray, window: int) -> np.ndarray:
    """Trailing running mean over `window` points, ignoring NaNs (NaN where the whole window is NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.array([np.nanmean(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))])


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (each seed: one run per algorithm)")
    parser.add_argument("--work", default=str(ROOT / "runs" / "compare"), help="task files, run directories, logs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare"), help="report directory")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--questions_per_step", type=int, default=2)
    parser.add_argument("--max_response_tokens", type=int, default=160)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--eval_limit", type=int, default=20, help="held-out questions (half lookups, half two-hop)")
    parser.add_argument("--eval_n", type=int, default=4, help="samples per held-out question (Pass@1 and Pass@n)")
    parser.add_argument("--report_only", action="store_true", help="only aggregate the finished runs in --work")
    return parser


def main() -> None:
    args = main_parser().parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    task = make_task(Path(args.work) / "task")
    if not args.report_only:
        # algorithm-major order: the runs of one seed share a cached cold start, made by its GRPO run
        jobs = [(a, s) for a in ALGOS for s in seeds]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_one, a, s, task, args) for a, s in jobs]
            for fut in concurrent.futures.as_completed(futures):
                print(fut.result(), flush=True)
    report(args, seeds, task)


if __name__ == "__main__":
    main()
