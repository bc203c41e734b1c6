"""AEPO against the paper's RL baselines at small scale: same model, data, budget and seeds; only the switches differ.

    python bench/compare_algorithms.py                      # 8 algorithms x 3 seeds, then the entropy-fall experiments
    python bench/compare_algorithms.py --only algorithms    # the 24 runs of results.md: 3 h 25 min on 2 cores
    python bench/compare_algorithms.py --only algorithms --seeds 0 --steps 4 --eval_limit 20   # a smaller look: 13 min
    python bench/compare_algorithms.py --only experiments --seeds 0,1   # bench/results/compare/experiments: 1 h 43 min
    python bench/compare_algorithms.py --only algorithms --seeds 0,1,2,3,4 --jobs 1 --threads 2
    python bench/compare_algorithms.py --only experiments --methods grpo,aepo,aepo-norollout   # some of them
    python bench/compare_algorithms.py --report_only        # re-aggregate the finished runs

Task: data/build_lookup.py (fictional people and firms behind the BM25 search tool; one- and two-search questions;
since 2026-12-06 12 of its 24 cold-start demonstrations search twice: the runs of results.md (2026-12-05) had none).
Model: the embedded SmolLM2-135M-Instruct, cold-started once per seed on the same 24 demonstrations, so every run of
a seed starts from the same weights. Algorithms: configs/<name>.yaml (algorithm.md §7): GRPO, REINFORCE++, DAPO, GPPO,
CISPO, GiGPO, ARPO, AEPO. The entropy-fall experiments are AEPO with one mechanism changed each (--only
experiments): `aepo-noentadv` (entropy-aware advantage off), `aepo-nosg` (PPO clip instead of the sg clip),
`aepo-norollout` (k independent samples instead of the tree), `aepo-halflr` (half the learning rate),
`aepo-shortcold` (2 cold-start steps instead of 8: a less sharpened start).

Generation uses vLLM's CPU build when this interpreter has it (run the script with .venv-vllm/bin/python, made by
`bash tests/vllm_stage.sh`), else the transformers backend (--backend forces one). Runs go to --work, `--jobs` at a
time with `--threads` torch threads each; a finished run is reused (only if it ran with the same command), an
unfinished one starts again. The report (results.md, results.json, one PNG per mechanism) goes to --out. Every seed
that ran is reported; none is dropped.
"""
import argparse
import concurrent.futures
import dataclasses
import importlib.util
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
sys.path.insert(0, str(ROOT / "data"))
sys.path.insert(0, str(ROOT))
from harness import jsonl  # noqa: E402
from harness.config import Config  # noqa: E402
from build_lookup import make_task  # noqa: E402

ALGOS = ("grpo", "reinforce_pp", "dapo", "gppo", "cispo", "gigpo", "arpo", "aepo")
EXPERIMENTS = {"aepo-noentadv": ["--entropy_advantage=false"], "aepo-nosg": ["--sg_clip=false"],
               "aepo-norollout": ["--entropy_branching=false"], "aepo-halflr": ["--lr={half_lr}"],
               "aepo-shortcold": ["--cold_start_kw={{questions: 24, steps: 2, batch: 3, lr: 5.0e-5}}"]}
OWN_START = {"aepo-shortcold"}                  # cold-started apart: the seed's shared start is not theirs
NAMES = {"grpo": "GRPO", "reinforce_pp": "REINFORCE++", "dapo": "DAPO", "gppo": "GPPO", "cispo": "CISPO",
         "gigpo": "GiGPO", "arpo": "ARPO", "aepo": "AEPO", "aepo-noentadv": "AEPO, no entropy advantage",
         "aepo-nosg": "AEPO, PPO clip", "aepo-norollout": "AEPO, no tree", "aepo-halflr": "AEPO, half lr",
         "aepo-shortcold": "AEPO, 2 cold-start steps"}
COLORS = {"grpo": "tab:gray", "reinforce_pp": "tab:brown", "dapo": "tab:olive", "gppo": "tab:purple",
          "cispo": "tab:cyan", "gigpo": "tab:green", "arpo": "tab:blue", "aepo": "tab:red",
          "aepo-noentadv": "tab:orange", "aepo-nosg": "tab:pink", "aepo-norollout": "black", "aepo-halflr": "gold",
          "aepo-shortcold": "lime"}
MECHANISMS = [("entropy", "policy token entropy"), ("diversity", "rollout diversity"),
              ("tool_calls", "tool calls per trajectory"), ("reward", "training reward"),
              ("pass1", "held-out Pass@1"), ("clip", "gradient kept / dropped by the clip")]


def train_argv(name: str, seed: int, task: dict, args) -> list[str]:
    """The exact train.py command line of one run (printed in the report)."""
    algo, extra = name.split("-")[0], EXPERIMENTS.get(name, [])
    return ["train.py", "--config", f"configs/{algo}.yaml", f"--seed={seed}", f"--run_name={name}-s{seed}",
            f"--out_dir={args.work}/runs", f"--train_data={task['train']}", f"--eval_data={task['test']}",
            "--search_kw", json.dumps({"corpus_path": task["corpus"], "topk": 1}), f"--backend={args.backend}",
            f"--steps={args.steps}", f"--k={args.k}", f"--questions_per_step={args.questions_per_step}",
            f"--max_response_tokens={args.max_response_tokens}", f"--lr={args.lr}",
            f"--eval_limit={args.eval_limit}", f"--eval_n={args.eval_n}", f"--eval_every={args.eval_every}",
            f"--eval_before={str(name == 'grpo').lower()}", "--save_every=0", "--keep_checkpoints=1",
            "--save_trainer_state=false", "--device=cpu",
            *[flag.format(half_lr=args.lr / 2) for flag in extra]]


def run_one(name: str, seed: int, task: dict, args) -> str:
    run_dir = Path(args.work) / "runs" / f"{name}-s{seed}"
    argv = train_argv(name, seed, task, args)
    log = Path(args.work) / "logs" / f"{name}-s{seed}.log"
    argv_file = log.with_suffix(".argv.json")
    if (run_dir / "eval" / "after_summary.json").exists():
        if not argv_file.exists() or json.loads(argv_file.read_text()) != argv:
            raise RuntimeError(f"{run_dir} finished with other settings than these; pass another --work or "
                               "delete it")
        return f"{name}-s{seed}: done before, reused"
    shutil.rmtree(run_dir, ignore_errors=True)                 # an unfinished run starts again
    log.parent.mkdir(parents=True, exist_ok=True)
    argv_file.write_text(json.dumps(argv))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        how = f"exited {proc.returncode}" if proc.returncode > 0 else f"was killed by signal {-proc.returncode}"
        if proc.returncode == -9:
            how += " (out of memory? each run needs about 6 GB)"
        raise RuntimeError(f"{name}-s{seed}: train.py {how}; see {log}")
    return f"{name}-s{seed}: {time.time() - t0:.0f} s"


def load_run(run_dir: Path) -> dict:
    if not (run_dir / "metrics.jsonl").exists() or not (run_dir / "eval" / "after_summary.json").exists():
        raise FileNotFoundError(f"{run_dir.name}: no finished run in {run_dir} (run without --report_only)")
    rows = [json.loads(line) for line in jsonl.lines((run_dir / "metrics.jsonl").read_text(encoding="utf-8")) if line.strip()]
    ev = {p.name[:-len("_summary.json")]: json.loads(p.read_text()) for p in (run_dir / "eval").glob("*_summary.json")}
    return {"metrics": rows, "eval": ev}


def pass1_curve(run: dict, steps: int, eval_every: int, key: str = "pass@1") -> list[tuple[int, float]]:
    """(step, held-out Pass@1, or the summaries' `key`) of the run's evaluations: the start (step 0), every eval_every
    steps, after the last."""
    points = [(0, run["eval"]["before"][key])] if "before" in run["eval"] else []
    points += [(s, run["eval"][f"step{s}"][key]) for s in range(eval_every, steps, eval_every or steps + 1)
               if f"step{s}" in run["eval"]]
    return points + [(steps, run["eval"]["after"][key])]


def per_question(run_dir: Path, name: str, key: str = "correct") -> np.ndarray | None:
    """(questions,) the share of evaluation `name`'s samples that were correct (or had `key` true, e.g.
    format_valid), per held-out question, in the data's order (eval.py's {name}_results.jsonl); None where the rows
    do not list their samples."""
    text = (run_dir / "eval" / f"{name}_results.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in jsonl.lines(text) if line.strip()]
    rows.sort(key=lambda r: r["index"])
    if key == "correct":
        return np.array([r["num_correct"] / r["n"] for r in rows], dtype=float)
    if not all(isinstance(r.get("samples"), list) for r in rows):
        return None
    return np.array([statistics.fmean(bool(x[key]) for x in r["samples"]) for r in rows], dtype=float)


def interval(values: np.ndarray, reps: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of a (seeds, questions) array and its 95% interval: the percentile bootstrap that resamples the seeds
    and the questions independently, so that both the training runs' spread and the question sample's count. For a
    paired difference pass the difference of two methods' arrays (the same seeds and questions)."""
    rng = np.random.default_rng(seed)
    n_seeds, n_questions = values.shape
    seeds = rng.integers(0, n_seeds, (reps, n_seeds))
    questions = rng.integers(0, n_questions, (reps, n_questions))
    means = values[seeds[:, :, None], questions[:, None, :]].mean(axis=(1, 2))
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(values.mean()), float(lo), float(hi)


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def per_seed_numbers(run: dict, k: int) -> dict:
    ms, after = run["metrics"], run["eval"]["after"]
    half = ms[len(ms) // 2:]

    def avg(key, rows=ms):
        return statistics.fmean(m[key] for m in rows)
    return {"pass@1": after["pass@1"], f"pass@{k}": after[f"pass@{k}"], "eval_tool_calls": after["tool_calls"],
            "train_reward_2nd_half": avg("reward", half), "entropy_first": ms[0]["entropy"],
            "entropy_last_3": avg("entropy", ms[-3:]), "diversity_answers": avg("diversity/answers"),
            "diversity_tokens": avg("diversity/tokens"), "diversity_tool_seqs": avg("diversity/tool_seqs"),
            "tool_calls": avg("tool_calls"), "clip_hi": avg("clip_hi"), "clip_lo": avg("clip_lo"),
            "grad_kept": avg("grad_kept"), "grad_dropped": avg("grad_dropped"), "branches": avg("branches"),
            "searches_executed": sum(m.get("tools/search/calls", 0) for m in ms), "step_s": avg("time/step"),
            **({"branch_top_chain": avg("branch_top_chain")} if "branch_top_chain" in ms[0] else {}),
            **({"probe_first": ms[0]["probe_entropy"], "probe_last": ms[-1]["probe_entropy"],
                "probe_change": ms[-1]["probe_entropy"] - ms[0]["probe_entropy"]} if "probe_entropy" in ms[0] else {})}


def report(args, names: list[str], seeds: list[int], out: Path) -> dict:
    runs = {(a, s): load_run(Path(args.work) / "runs" / f"{a}-s{s}") for a in names for s in seeds}
    k = args.eval_n
    res = {"seeds": seeds, "settings": {key: getattr(args, key) for key in (
               "steps", "k", "questions_per_step", "max_response_tokens", "lr", "eval_limit", "eval_n", "eval_every",
               "backend")},
           "train_commands": {a: "python " + shlex.join(json.loads((Path(args.work) / "logs" / f"{a}-s{seeds[0]}"
                                                                  ".argv.json").read_text())).replace(f"{ROOT}/", "")
                              for a in names},
           "before": {s: {m: runs[names[0], s]["eval"]["before"][m] for m in ("pass@1", f"pass@{k}")}
                      for s in seeds if "before" in runs[names[0], s]["eval"]},
           "algos": {}}
    work = Path(args.work) / "runs"
    after = {a: np.stack([per_question(work / f"{a}-s{s}", "after") for s in seeds]) for a in names}
    start = None
    if len(res["before"]) == len(seeds):                                 # the start every run of a seed shares
        start = np.stack([per_question(work / f"{names[0]}-s{s}", "before") for s in seeds])
        res["start_pass@1"] = interval(start)
    fmt = {a: [per_question(work / f"{a}-s{s}", "after", "format_valid") for s in seeds] for a in names}
    fmt_start = ([per_question(work / f"{names[0]}-s{s}", "before", "format_valid") for s in seeds]
                 if start is not None else [None])
    has_fmt = all(x is not None for xs in [*fmt.values(), fmt_start] for x in xs)
    if has_fmt:                                  # what the reward teaches beside the answer: the format
        res["start_format_valid"] = interval(np.stack(fmt_start))
    for a in names:
        per_seed = {s: per_seed_numbers(runs[a, s], k) for s in seeds}
        res["algos"][a] = {"per_seed": per_seed,
                           "mean_sd": {key: mean_sd([per_seed[s][key] for s in seeds]) for key in per_seed[seeds[0]]},
                           "pass@1": interval(after[a]), "questions": after[a].shape[1]}
        if start is not None and a not in OWN_START:
            res["algos"][a]["gain"] = interval(after[a] - start)
        if has_fmt:
            res["algos"][a]["format_valid"] = interval(np.stack(fmt[a]))
            if a not in OWN_START:
                res["algos"][a]["format_gain"] = interval(np.stack(fmt[a]) - np.stack(fmt_start))
        if "aepo" in names and a != "aepo":
            res["algos"][a]["aepo_minus"] = interval(after["aepo"] - after[a])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    table = markdown(res, names, k)
    (out / "results.md").write_text(table)
    for key, title in MECHANISMS:
        plot(runs, names, seeds, key, title, args, out / f"{key}.png")
    print(table)
    return res


def markdown(res: dict, names: list[str], k: int) -> str:
    seeds = res["seeds"]

    def cell(a, key, fmt="{:.3f}", seeds_too=False):
        mean, sd = res["algos"][a]["mean_sd"][key]
        text = f"{fmt.format(mean)} ± {fmt.format(sd)}"
        if seeds_too:
            text += " [" + ", ".join(fmt.format(res["algos"][a]["per_seed"][s][key]) for s in seeds) + "]"
        return text
    before = [res["before"][s]["pass@1"] for s in seeds if s in res["before"]]

    def row_keys(a):                           # runs from before the probe and the branch statistics lack them
        return res["algos"][a]["mean_sd"]

    def probe(a):                              # each run's own probe: compare the change, not the levels
        if "probe_change" not in row_keys(a):
            return "–"
        return (f"{cell(a, 'probe_first', '{:.3f}')} → {cell(a, 'probe_last', '{:.3f}')} "
                f"({cell(a, 'probe_change', '{:.3f}', seeds_too=True)})")

    def branching(a):                          # only the tree rollouts branch
        if not row_keys(a).get("branches", (0,))[0] or "branch_top_chain" not in row_keys(a):
            return "–"
        return f"{cell(a, 'branches', '{:.2f}')}, {cell(a, 'branch_top_chain', '{:.2f}')}"

    def ci(triple):
        return f"{triple[0]:.3f} [{triple[1]:.3f}, {triple[2]:.3f}]"
    start = res.get("start_pass@1")
    q = res["algos"][names[0]]["questions"]
    intervals = [f"Held-out Pass@1 over {q} questions x {k} samples and seeds {', '.join(map(str, seeds))}: mean and "
                 "95% interval (bootstrap over seeds and questions); the paired difference compares the same "
                 "questions of the same seeds, each seed's methods from the same start.", "",
                 "| | start | after training | after − start | AEPO − this method | format valid after "
                 "| its after − start |",
                 "|---|---|---|---|---|---|---|"]
    for a in names:
        row = res["algos"][a]
        gain = ci(row["gain"]) if "gain" in row else "–"
        own = ci(start) if start and a not in OWN_START else "–"
        intervals.append(f"| {NAMES[a]} | {own} | {ci(row['pass@1'])} | {gain} | "
                         f"{ci(row['aepo_minus']) if 'aepo_minus' in row else '–'} | "
                         f"{ci(row['format_valid']) if 'format_valid' in row else '–'} | "
                         f"{ci(row['format_gain']) if 'format_gain' in row else '–'} |")
    if "start_format_valid" in res:
        intervals += ["", f"Format valid (the share of held-out samples in the agent's format, which the reward scores "
                      f"beside the answer) at the start: {ci(res['start_format_valid'])}."]
    lines = [*intervals, "", f"Mean ± sd over seeds {', '.join(map(str, seeds))} (per-seed values in brackets). Start (the "
             f"cold-started model every run of a seed begins from): held-out Pass@1 "
             f"{mean_sd(before)[0]:.3f} ± {mean_sd(before)[1]:.3f}." if before else "", "",
             f"| | Pass@1 after | Pass@{k} after | train reward (2nd half) | entropy step 1 → last 3 | diversity: answers "
             "/ tokens / tool calls | tool calls / traj | clip hi / lo | grad kept / dropped | searches run | s / step |"
             " probe entropy step 1 → last (change) | branches / question, share on the top chain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in names:
        lines.append(f"| {NAMES[a]} | {cell(a, 'pass@1', seeds_too=True)} | {cell(a, f'pass@{k}')} "
                     f"| {cell(a, 'train_reward_2nd_half')} | {cell(a, 'entropy_first', '{:.2f}')} → "
                     f"{cell(a, 'entropy_last_3', '{:.2f}')} | {cell(a, 'diversity_answers', '{:.2f}')} / "
                     f"{cell(a, 'diversity_tokens', '{:.2f}')} / {cell(a, 'diversity_tool_seqs', '{:.2f}')} "
                     f"| {cell(a, 'tool_calls', '{:.2f}')} | {cell(a, 'clip_hi', '{:.4f}')} / "
                     f"{cell(a, 'clip_lo', '{:.4f}')} | {cell(a, 'grad_kept', '{:.4f}')} / "
                     f"{cell(a, 'grad_dropped', '{:.4f}')} | {cell(a, 'searches_executed', '{:.0f}')} "
                     f"| {cell(a, 'step_s', '{:.0f}')} | {probe(a)} | {branching(a)} |")
    lines += ["", "Entropy step 1 → last 3: the entropy of the tokens each step sampled (it moves with the questions "
              "drawn and with what the tree samples). Probe entropy: the policy's own entropy, teacher-forced on the "
              "same few trajectories at every step; each run samples its probe once from its start, so compare the "
              "change, not the level."]
    return "\n".join(lines) + "\n"


def plot(runs: dict, names: list[str], seeds: list[int], key: str, title: str, args, path: Path) -> None:
    """One mechanism over the steps, one line per algorithm (mean over seeds, 3-step running mean; band: min-max)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = {"diversity": [("diversity/answers", "distinct answers / k"), ("diversity/tokens", "token dissimilarity"),
                            ("diversity/tool_seqs", "distinct tool-call sequences / k"),
                            ("branch_top_chain", "branch concentration: share of a tree's branches on its top chain")],
              "clip": [("grad_kept", "share of tokens the clip kept a gradient for"),
                       ("grad_dropped", "share of tokens the clip dropped")],
              "entropy": [("entropy", "sampled tokens' entropy (the step's rollout)"),
                          ("probe_entropy", "the policy's entropy on the probe (the same tokens every step)")],
              "pass1": [("pass@1", "held-out Pass@1"), ("format_valid", "held-out samples in the agent's format")]
              }.get(key, [(key, title)])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (metric, label) in zip(axes.flat, panels):
        starts = [runs[names[0], s]["eval"].get("before", {}).get(metric) for s in seeds]   # the seed's shared start
        for a in names:
            if key == "pass1":
                if any(metric not in runs[a, s]["eval"]["after"] for s in seeds):
                    continue                                             # summaries from before the key
                curves = [pass1_curve(runs[a, s], args.steps, args.eval_every, metric) for s in seeds]
                curves = [[(0, start), *c] if c[0][0] and start is not None and a not in OWN_START else c
                          for c, start in zip(curves, starts)]
                steps = np.array([step for step, _ in curves[0]])
                vals = np.array([[v for _, v in c] for c in curves], dtype=float)
                mean, lo, hi = vals.mean(0), vals.min(0), vals.max(0)
            else:
                vals = np.array([[m.get(metric, np.nan) for m in runs[a, s]["metrics"]] for s in seeds],
                                dtype=float)                     # runs from before the probe have none
                steps = np.arange(1, vals.shape[1] + 1)
                mean, lo, hi = (running_mean(f(vals, axis=0), 3) for f in (np.mean, np.min, np.max))
            if metric == "branch_top_chain" and not np.nanmax(hi, initial=0):
                continue                                                 # a method that does not branch
            ax.plot(steps, mean, color=COLORS[a], label=NAMES[a], marker="." if key == "pass1" else None)
            ax.fill_between(steps, lo, hi, color=COLORS[a], alpha=0.08)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="best")                          # every method has a line there
    fig.suptitle(f"{title}: lookup task, SmolLM2-135M, seeds {', '.join(map(str, seeds))}", fontsize=10)
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
    parser.add_argument("--only", default="all", choices=["all", "algorithms", "experiments"],
                        help="the algorithms, the entropy-fall experiments, or both")
    parser.add_argument("--work", default=str(ROOT / "runs" / "compare"), help="task files, run directories, logs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare"), help="report directory")
    parser.add_argument("--methods", default="", help="comma-separated: only these of --only's methods (e.g. "
                        "grpo,aepo,aepo-norollout; default all)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--backend", default="vllm" if importlib.util.find_spec("vllm") else "transformers",
                        choices=["vllm", "transformers"], help="generation backend (default: vLLM when installed)")
    default = {f.name: f.default for f in dataclasses.fields(Config)}     # the default run's settings
    for key in ("steps", "k", "questions_per_step", "max_response_tokens", "lr"):
        parser.add_argument(f"--{key}", type=type(default[key]), default=default[key],
                            help=f"train.py's (default {default[key]}, the default run's)")
    parser.add_argument("--eval_limit", type=int, default=100, help="held-out questions (half lookups, half two-hop)")
    parser.add_argument("--eval_n", type=int, default=default["eval_n"],
                        help="samples per held-out question (Pass@1 and Pass@n)")
    parser.add_argument("--eval_every", type=int, default=4, help="held-out evaluation every N steps (the Pass@1 curve)")
    parser.add_argument("--report_only", action="store_true", help="only aggregate the finished runs in --work")
    return parser


def chosen_reports(args: argparse.Namespace) -> dict[str, tuple[list[str], Path]]:
    """{report: (its methods, its folder)} for --only and --methods; ValueError names a method --only does not have."""
    reports = {"algorithms": (list(ALGOS), Path(args.out)),
               "experiments": (["grpo", "aepo", *EXPERIMENTS], Path(args.out) / "experiments")}
    reports = {key: value for key, value in reports.items() if args.only in ("all", key)}
    if not args.methods:
        return reports
    wanted = args.methods.split(",")
    known = list(dict.fromkeys(a for names, _ in reports.values() for a in names))     # grpo, aepo: in both
    if unknown := [a for a in wanted if a not in known]:
        raise ValueError(f"--methods: {', '.join(unknown)} not among --only {args.only}'s: {', '.join(known)}")
    return {key: ([a for a in names if a in wanted], out) for key, (names, out) in reports.items()
            if any(a in wanted for a in names)}


def main() -> None:
    args = main_parser().parse_args()
    if args.eval_limit < 1:
        main_parser().error("--eval_limit must be at least 1: the task is built with that many held-out questions")
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        reports = chosen_reports(args)
    except ValueError as e:
        main_parser().error(str(e))
    task = make_task(Path(args.work) / "task", n_test=args.eval_limit)
    if not args.report_only:
        started = time.time()
        # seed-major order: a comparison stopped early holds whole seeds (a rerun reuses every finished run)
        names = list(dict.fromkeys(a for group, _ in reports.values() for a in group))
        jobs = [(a, s) for s in seeds for a in names]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_one, a, s, task, args) for a, s in jobs]
            failed = []
            for fut in concurrent.futures.as_completed(futures):
                try:
                    print(fut.result(), flush=True)
                except RuntimeError as e:                      # the other runs go on; the report waits for a rerun
                    failed.append(str(e))
                    print(e, flush=True)
        print(f"all runs: {(time.time() - started) / 60:.0f} min", flush=True)
        if failed:
            sys.exit(f"{len(failed)} of {len(jobs)} runs failed (above); the same command reruns them and reuses "
                     "the finished ones")
    for names, out in reports.values():
        report(args, names, seeds, out)


if __name__ == "__main__":
    main()
