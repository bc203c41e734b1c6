"""Does RL teach the lookup task? AEPO in the learning setting (configs/learn.yaml), several seeds, before and after.

    .venv-vllm/bin/python bench/learn.py                     # seeds 0,1,2 -> bench/results/learn/
    .venv-vllm/bin/python bench/learn.py --seeds 0 --jobs 1  # one run
    python bench/learn.py --report_only                      # the report again from the finished runs

Each seed is one `python train.py --config configs/learn.yaml --seed S` (the cold start is seeded too, so each seed
has its own start); held-out Pass@1 on the config's 100 questions x 2 samples before and after, and the gain after -
start with a 95% interval (a bootstrap over seeds and questions: bench/compare_algorithms.py's `interval`), overall
and per question type (lookup / two_hop). A run that stopped resumes from its last checkpoint (--resume true); a
finished one is reused when it ran the same command. While a run trains, its processes' resident memory is sampled
every 5 s (<work>/logs/<run>.rss.tsv: seconds, GB, the run's last log line), so the report gives each run's peak and
the phase it was in.
"""
from __future__ import annotations

import argparse
import importlib.util
import concurrent.futures
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import run_train  # noqa: E402
from compare_algorithms import interval, per_question  # noqa: E402
from harness import jsonl  # noqa: E402

TYPES = ("lookup", "two_hop")


def train_argv(seed: int, args) -> list[str]:
    return ["train.py", "--config", args.config, f"--seed={seed}", f"--run_name=learn-s{seed}",
            f"--out_dir={args.work}/runs", f"--backend={args.backend}", "--device=cpu", *args.extra]


def run_one(seed: int, args) -> str:
    return run_train.run(f"learn-s{seed}", train_argv(seed, args), Path(args.work), args.threads)


def searches(run_dir: Path, name: str) -> dict:
    """Per question type, the held-out samples of evaluation `name` by their search calls against what the type needs
    (lookup 1, two_hop 2): shares with fewer, as many, more, and truncated."""
    need, out = {"lookup": 1, "two_hop": 2}, {}
    rows = [json.loads(line) for line in jsonl.lines((run_dir / "eval" / f"{name}_results.jsonl").read_text(
        encoding="utf-8")) if line.strip()]
    for kind, hops in need.items():
        samples = [x for r in rows if r["meta"].get("type") == kind for x in r["samples"]]
        calls = [sum(c[0] == "search" for c in x["tool_calls"]) for x in samples]
        n = max(1, len(samples))
        out[kind] = {"fewer": sum(c < hops for c in calls) / n, "as_needed": sum(c == hops for c in calls) / n,
                     "more": sum(c > hops for c in calls) / n, "truncated": sum(x["truncated"] for x in samples) / n}
    return out


def report(args, seeds: list[int]) -> dict:
    work = Path(args.work)
    runs = [work / "runs" / f"learn-s{s}" for s in seeds]
    types = [json.loads(line)["meta"].get("type") for line in
             jsonl.lines((runs[0] / "eval" / "after_results.jsonl").read_text(encoding="utf-8")) if line.strip()]
    before = np.stack([per_question(r, "before") for r in runs])
    after = np.stack([per_question(r, "after") for r in runs])
    res = {"seeds": seeds, "config": args.config, "backend": args.backend, "note": args.note,
           "command": "python " + shlex.join(train_argv(seeds[0], args)).replace(f"{ROOT}/", ""),
           "questions": int(after.shape[1]), "types": {t: types.count(t) for t in TYPES},
           "algos": {"aepo": {"start": interval(before), "pass@1": interval(after), "gain": interval(after - before),
                              "by_type": {}}},
           "runs": {}}
    for t in TYPES:
        cols = [i for i, x in enumerate(types) if x == t]
        res["algos"]["aepo"]["by_type"][t] = {"start": interval(before[:, cols]), "pass@1": interval(after[:, cols]),
                                              "gain": interval(after[:, cols] - before[:, cols])}
    for s, r in zip(seeds, runs):
        log = work / "logs" / f"learn-s{s}.log"
        metrics = [json.loads(line) for line in jsonl.lines((r / "metrics.jsonl").read_text(encoding="utf-8"))
                   if line.strip()]
        gb, phase = run_train.peak(log.with_suffix(".rss.tsv")) if log.with_suffix(".rss.tsv").exists() else (0.0, "")
        wall = log.with_suffix(".wall_s")
        res["runs"][s] = {"wall_min": round(int(wall.read_text()) / 60, 1) if wall.exists() else None,
                          "peak_rss_gb": gb, "peak_during": phase,
                          "before": json.loads((r / "eval" / "before_summary.json").read_text())["pass@1"],
                          "after": json.loads((r / "eval" / "after_summary.json").read_text())["pass@1"],
                          "searches": {name: searches(r, name) for name in ("before", "after")},
                          "frac_reward_zero_std": [m["frac_reward_zero_std"] for m in metrics],
                          "two_hop_acc": [m.get("type/two_hop/acc") for m in metrics],
                          "two_hop_searches": [m.get("type/two_hop/searches") for m in metrics],
                          "peak_gb_by_phase": {k.split("/")[1]: max(m[k] for m in metrics if k in m) for k in
                                               sorted({k for m in metrics for k in m if k.startswith("memory/")})}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return res


def markdown(res: dict) -> str:
    def ci(x):
        return f"{x[0]:.3f} [{x[1]:.3f}, {x[2]:.3f}]"
    a = res["algos"]["aepo"]
    lines = [f"# AEPO in the learning setting ({time.strftime('%Y-%m-%d')})", "",
             f"`{res['command']}` and the same for seeds {', '.join(map(str, res['seeds']))} (backend "
             f"{res['backend']}). Held-out: {res['questions']} questions ({res['types']['lookup']} lookups, "
             f"{res['types']['two_hop']} two-hop) x 2 samples at temperature 0.6, before and after; mean and 95% "
             "interval, a bootstrap over seeds and questions." + (f" {res['note']}" if res.get("note") else ""), "",
             "| questions | start | after | after − start |", "|---|---|---|---|",
             f"| all | {ci(a['start'])} | {ci(a['pass@1'])} | {ci(a['gain'])} |"]
    lines += [f"| {t} | {ci(v['start'])} | {ci(v['pass@1'])} | {ci(v['gain'])} |" for t, v in a["by_type"].items()]
    lines += ["", "| seed | before | after | wall (min) | peak memory (GB, the run's processes) | during | groups with "
              "equal rewards, first → last 4 steps | two-hop training success, first → last 4 steps |",
              "|---|---|---|---|---|---|---|---|"]
    for s, r in res["runs"].items():
        z, acc = r["frac_reward_zero_std"], [x for x in r["two_hop_acc"] if x is not None]
        lines.append(f"| {s} | {r['before']:.3f} | {r['after']:.3f} | {r['wall_min']} | {r['peak_rss_gb']:.1f} | "
                     f"{r['peak_during'][:60]} | {np.mean(z[:4]):.2f} → {np.mean(z[-4:]):.2f} | "
                     f"{np.mean(acc[:4]) if acc else float('nan'):.2f} → "
                     f"{np.mean(acc[-4:]) if acc else float('nan'):.2f} |")
    lines += [f"- seed {s}: the training process's peak resident GB per phase, the largest over its steps "
              "(metrics.jsonl memory/*): " + ", ".join(f"{k} {v:.1f}" for k, v in r["peak_gb_by_phase"].items())
              for s, r in res["runs"].items() if r.get("peak_gb_by_phase")]
    lines += ["", "Held-out samples by their searches against what the type needs (lookup 1, two-hop 2): fewer / as "
              "many / more, and truncated (512 tokens), before → after:"]
    for s, r in res["runs"].items():
        for kind in ("lookup", "two_hop"):
            b, a = r["searches"]["before"][kind], r["searches"]["after"][kind]
            lines.append(f"- seed {s}, {kind}: " + "; ".join(f"{key.replace('_', ' ')} {b[key]:.2f} → {a[key]:.2f}"
                                                              for key in ("fewer", "as_needed", "more", "truncated")))
    lines += ["", "Two-hop training success per step (exact match of the step's two-hop trajectories; – where "
              "the step drew no two-hop question):"]
    lines += [f"- seed {s}: " + ", ".join("–" if x is None else f"{x:.2f}" for x in r["two_hop_acc"])
              for s, r in res["runs"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config", default="configs/learn.yaml")
    parser.add_argument("--work", default=str(ROOT / "runs" / "learn"), help="run directories and logs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learn"))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--backend", default="vllm" if importlib.util.find_spec("vllm") else "transformers",
                        choices=["vllm", "transformers"])
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--note", default="", help="a line the report prints under its command (what differed)")
    parser.add_argument("extra", nargs="*", help="more train.py flags for every run (after --)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.report_only:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for line in pool.map(lambda s: run_one(s, args), seeds):
                print(line, flush=True)
    report(args, seeds)


if __name__ == "__main__":
    main()
