"""AEPO against GRPO and ARPO where RL learns (configs/learn.yaml's setting): the same model, cold start, questions and
budget per seed; only the algorithm's switches differ (configs/<name>.yaml, algorithm.md §7).

    .venv-vllm/bin/python bench/compare_algorithms.py                 # GRPO, ARPO, AEPO x seeds 0-4 -> bench/results/compare/
    .venv-vllm/bin/python bench/compare_algorithms.py --seeds 0 --steps 12 --eval_limit 60    # the smaller look (~1 h)
    .venv-vllm/bin/python bench/compare_algorithms.py --methods grpo,reinforce_pp,dapo,gppo,cispo,gigpo,arpo,aepo --seeds 0,1
    .venv-vllm/bin/python bench/compare_algorithms.py --only experiments --seeds 0,1   # AEPO, one mechanism changed each
    python bench/compare_algorithms.py --report_only                  # re-aggregate the finished runs

Task: data/build_lookup.py with a third of the questions three-hop (`--three_hop_every 3`; the cold start's 24
demonstrations hold `--three_hop_demos` three-hop and 3 two-hop ones: bench/results/gate/), built under --work: fictional
people and firms behind BM25 top-1, so each question needs one, two or three searches (3 tool calls allowed;
learn.yaml's 2 without three-hop questions), and every multi-hop success hinges on the decision right after a tool
result (answer now, or search what it named), where AEPO and ARPO branch.
Model: the embedded SmolLM2-135M-Instruct, cold-started once per seed (the cold start is cached by its data and
seed), so every run of a seed starts from the same weights; GRPO's run evaluates that start (--eval_before), the others
only after. Held-out: the first --eval_limit test questions x --eval_n samples at temperature 0.6, after − start and
the paired AEPO − method (the same seeds and questions) with 95% intervals, overall and per question type. The
mechanism table: informative groups (unequal rewards) per step, branches and the pre-monitor's m per question, by type;
branches on a tree's top chain; gradient kept and dropped by the clip; the probe's entropy change; held-out searches
per correct answer. The other five algorithms (REINFORCE++, DAPO, GPPO, CISPO, GiGPO) run with --methods, and the
entropy-fall experiments with --only experiments: AEPO with one mechanism changed each (`aepo-noentadv`: entropy-aware
advantage off, `aepo-nosg`: PPO clip, `aepo-norollout`: k independent samples, `aepo-halflr`: half the learning rate,
`aepo-shortcold`: 2 cold-start steps).

Generation uses vLLM's CPU build when this interpreter has it (.venv-vllm/bin/python, made by
`bash tests/vllm_stage.sh`), else transformers (--backend forces one). Runs go to --work, `--jobs` at a time with
`--threads` torch threads each (bench/run_train.py): a finished run is reused when it ran the same command, a stopped one
resumes from its last checkpoint (every 8 steps), and a finished run's checkpoints are deleted. The report
(results.md, results.json, one PNG per mechanism) goes to --out. Every seed that ran is reported; none is dropped.
"""
import argparse
import concurrent.futures
import importlib.util
import json
import shlex
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import run_train  # noqa: E402
from harness import jsonl  # noqa: E402
from harness.config import parse_config  # noqa: E402
from build_lookup import SEARCHES, make_task  # noqa: E402

ALGOS = ("grpo", "reinforce_pp", "dapo", "gppo", "cispo", "gigpo", "arpo", "aepo")
MAIN = ("grpo", "arpo", "aepo")                 # the issue's comparison; the other five with --methods
TUNABLE = ("steps", "k", "questions_per_step", "max_response_tokens", "lr")    # --config's unless given
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
              ("pass1", "held-out Pass@1"), ("clip", "gradient kept / dropped by the clip"),
              ("types", "training success and searches by question type")]


def train_argv(name: str, seed: int, task: dict, args) -> list[str]:
    """The exact train.py command line of one run (printed in the report)."""
    algo, extra = name.split("-")[0], EXPERIMENTS.get(name, [])
    half_lr = settings(args)["lr"] / 2
    calls = tool_call_limit(args)
    return ["train.py", "--config", args.config, "--config", f"configs/{algo}.yaml", f"--seed={seed}",
            f"--run_name={name}-s{seed}", f"--out_dir={args.work}/runs", f"--train_data={task['train']}",
            f"--eval_data={task['test']}", "--search_kw", json.dumps({"corpus_path": task["corpus"], "topk": 1}),
            f"--backend={args.backend}", *[f"--{key}={getattr(args, key)}" for key in TUNABLE
                                           if getattr(args, key) is not None],
            *([f"--max_tool_calls={calls}"] if calls else []),
            f"--eval_limit={args.eval_limit}", f"--eval_n={args.eval_n}", f"--eval_every={args.eval_every}",
            f"--eval_before={str(name == 'grpo').lower()}", "--save_every=8", "--keep_checkpoints=1", "--device=cpu",
            *[flag.format(half_lr=half_lr) for flag in extra]]


def tool_call_limit(args) -> int | None:
    """--max_tool_calls, else 3 with three-hop questions (one per hop; learn.yaml's 2 is a two-hop question's)."""
    return args.max_tool_calls or (3 if args.three_hop_every else None)


def settings(args) -> dict:
    """The comparison's settings as the runs got them: --config's values where a flag was not given."""
    config = parse_config(["--config", args.config])
    return {"config": args.config, **{key: getattr(config, key) if getattr(args, key) is None else getattr(args, key)
                                      for key in TUNABLE},
            "max_tool_calls": tool_call_limit(args) or config.max_tool_calls,
            **{key: getattr(args, key) for key in ("eval_limit", "eval_n", "eval_every", "backend", "three_hop_every",
                                                   "three_hop_demos")}}


def run_one(name: str, seed: int, task: dict, args) -> str:
    said = run_train.run(f"{name}-s{seed}", train_argv(name, seed, task, args), Path(args.work), args.threads)
    shutil.rmtree(Path(args.work) / "runs" / f"{name}-s{seed}" / "checkpoints", ignore_errors=True)   # finished
    return said


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


def eval_rows(run_dir: Path, name: str) -> list[dict]:
    """Evaluation `name`'s rows (eval.py's {name}_results.jsonl: one per held-out question) in the data's order."""
    text = (run_dir / "eval" / f"{name}_results.jsonl").read_text(encoding="utf-8")
    return sorted((json.loads(line) for line in jsonl.lines(text) if line.strip()), key=lambda r: r["index"])


def kind_of(row: dict) -> str | None:
    return row.get("meta", {}).get("type")


def searches(sample: dict) -> int:
    return sum(call[0] == "search" for call in sample.get("tool_calls", []))


def per_question(run_dir: Path, name: str, key: str = "correct") -> np.ndarray | None:
    """(questions,) the share of evaluation `name`'s samples that were correct (or had `key` true, e.g.
    format_valid), per held-out question, in the data's order (eval.py's {name}_results.jsonl); None where the rows
    do not list their samples."""
    rows = eval_rows(run_dir, name)
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


def question_types(run_dir: Path, name: str = "after") -> list[str | None]:
    """The held-out questions' types (their data's `type`), in the order of per_question."""
    return [kind_of(r) for r in eval_rows(run_dir, name)]


def searches_per_correct(run_dir: Path, name: str = "after") -> dict[str, float]:
    """Held-out search calls per correct answer (all samples' searches over the correct samples), overall and per
    question type: what a correct answer costs in tool calls."""
    rows = eval_rows(run_dir, name)
    out = {}
    for kind in [None, *sorted({kind_of(r) for r in rows} - {None})]:
        mine = [x for r in rows if kind is None or kind_of(r) == kind for x in r.get("samples", [])]
        correct = sum(bool(x.get("correct")) for x in mine)
        calls = sum(searches(x) for x in mine)
        if correct:                              # (none correct: no such number)
            out[kind or "all"] = calls / correct
    return out


def searches_by_type(run_dir: Path, name: str = "after") -> dict[str, float]:
    """Held-out search calls per sample by question type (`searches/<type>`), and the share of samples that searched
    exactly as often as their type needs (`as_needed/<type>`, build_lookup.SEARCHES): where a run settled."""
    rows = eval_rows(run_dir, name)
    out = {}
    for kind in sorted({kind_of(r) for r in rows} & set(SEARCHES)):
        counts = [searches(x) for r in rows if kind_of(r) == kind for x in r.get("samples", [])]
        if counts:
            out[f"searches/{kind}"] = statistics.fmean(counts)
            out[f"as_needed/{kind}"] = statistics.fmean(c == SEARCHES[kind] for c in counts)
    return out


def by_type(ms: list[dict]) -> dict:
    """Per question type, over a run's steps: informative groups (rewards not all equal: the only ones with an
    advantage) per step and as a share of that type's groups; branches and the pre-monitor's m per question."""
    out = {}
    for kind in sorted({key.split("/")[1] for m in ms for key in m if key.startswith("type/")}):
        at = f"type/{kind}/"
        rows = [m for m in ms if m.get(at + "questions")]
        n = sum(m[at + "questions"] for m in rows)
        informative = sum(m[at + "questions"] * (1 - m[at + "frac_reward_zero_std"]) for m in rows)
        out[f"informative/{kind}"] = informative / len(ms)
        if not n:
            continue
        out[f"informative_share/{kind}"] = informative / n
        for key in ("branches", "m"):
            if all(at + key in m for m in rows):                  # runs from before these metrics lack them
                out[f"{key}/{kind}"] = sum(m[at + "questions"] * m[at + key] for m in rows) / n
    return out


def per_seed_numbers(run: dict, k: int, run_dir: Path | None = None) -> dict:
    ms, after = run["metrics"], run["eval"]["after"]
    half = ms[len(ms) // 2:]
    branched = [m["branch_top_chain"] for m in ms if m.get("branches") and "branch_top_chain" in m]
    extra = {**by_type(ms), **({"top_chain": statistics.fmean(branched)} if branched else {})}
    if run_dir is not None and (run_dir / "eval" / "after_results.jsonl").exists():
        extra.update({f"searches_per_correct/{kind}": v for kind, v in searches_per_correct(run_dir).items()})
        extra.update(searches_by_type(run_dir))

    def avg(key, rows=ms):
        return statistics.fmean(m[key] for m in rows)
    return {"pass@1": after["pass@1"], f"pass@{k}": after[f"pass@{k}"], "eval_tool_calls": after["tool_calls"],
            "train_reward_2nd_half": avg("reward", half), "entropy_first": ms[0]["entropy"],
            "entropy_last_3": avg("entropy", ms[-3:]), "diversity_answers": avg("diversity/answers"),
            "diversity_tokens": avg("diversity/tokens"), "diversity_tool_seqs": avg("diversity/tool_seqs"),
            "tool_calls": avg("tool_calls"), "clip_hi": avg("clip_hi"), "clip_lo": avg("clip_lo"),
            "grad_kept": avg("grad_kept"), "grad_dropped": avg("grad_dropped"), "branches": avg("branches"),
            "searches_executed": sum(m.get("tools/search/calls", 0) for m in ms), "step_s": avg("time/step"),
            "train_min": sum(m["time/step"] for m in ms) / 60,
            "eval_min": sum(e.get("wall_s", 0) for e in run["eval"].values()) / 60,
            **({"branch_top_chain": avg("branch_top_chain")} if "branch_top_chain" in ms[0] else {}),
            **({"probe_first": ms[0]["probe_entropy"], "probe_last": ms[-1]["probe_entropy"],
                "probe_change": ms[-1]["probe_entropy"] - ms[0]["probe_entropy"]} if "probe_entropy" in ms[0] else {}),
            **extra}


def report(args, names: list[str], seeds: list[int], out: Path) -> dict:
    runs = {(a, s): load_run(Path(args.work) / "runs" / f"{a}-s{s}") for a in names for s in seeds}
    k = args.eval_n
    res = {"seeds": seeds, "settings": settings(args),
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
        types = question_types(work / f"{names[0]}-s{seeds[0]}")
        res["start_by_type"] = {t: interval(start[:, [i for i, x in enumerate(types) if x == t]])
                                for t in SEARCHES if t in types}
    fmt = {a: [per_question(work / f"{a}-s{s}", "after", "format_valid") for s in seeds] for a in names}
    fmt_start = ([per_question(work / f"{names[0]}-s{s}", "before", "format_valid") for s in seeds]
                 if start is not None else [None])
    has_fmt = all(x is not None for xs in [*fmt.values(), fmt_start] for x in xs)
    if has_fmt:                                  # what the reward teaches beside the answer: the format
        res["start_format_valid"] = interval(np.stack(fmt_start))
    types = question_types(work / f"{names[0]}-s{seeds[0]}")
    kinds = [t for t in SEARCHES if t in types]
    res["types"] = {t: types.count(t) for t in kinds}
    cols = {t: [i for i, x in enumerate(types) if x == t] for t in kinds}
    for a in names:
        per_seed = {s: per_seed_numbers(runs[a, s], k, work / f"{a}-s{s}") for s in seeds}
        common = [key for key in per_seed[seeds[0]] if all(key in per_seed[s] for s in seeds)]
        res["algos"][a] = {"per_seed": per_seed,
                           "mean_sd": {key: mean_sd([per_seed[s][key] for s in seeds]) for key in common},
                           "pass@1": interval(after[a]), "questions": after[a].shape[1],
                           "by_type": {t: {"pass@1": interval(after[a][:, c])} for t, c in cols.items()}}
        if start is not None and a not in OWN_START:
            res["algos"][a]["gain"] = interval(after[a] - start)
            for t, c in cols.items():
                res["algos"][a]["by_type"][t]["gain"] = interval(after[a][:, c] - start[:, c])
        if "aepo" in names and a != "aepo":
            for t, c in cols.items():
                res["algos"][a]["by_type"][t]["aepo_minus"] = interval(after["aepo"][:, c] - after[a][:, c])
        if has_fmt:
            res["algos"][a]["format_valid"] = interval(np.stack(fmt[a]))
            if a not in OWN_START:
                res["algos"][a]["format_gain"] = interval(np.stack(fmt[a]) - np.stack(fmt_start))
        if "aepo" in names and a != "aepo":
            res["algos"][a]["aepo_minus"] = interval(after["aepo"] - after[a])
    res["minutes"] = {part: sum(res["algos"][a]["per_seed"][s][f"{part}_min"] for a in names for s in seeds)
                      for part in ("train", "eval")}                   # steps and evaluations; not start-up
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
    intervals = [f"# {', '.join(NAMES[a] for a in names)} ({time.strftime('%Y-%m-%d')})", "",
                 f"Settings: {json.dumps(res['settings'])}.", "",
                 f"Time, {len(names) * len(seeds)} runs: {res['minutes']['train'] / 60:.1f} h of training steps and "
                 f"{res['minutes']['eval'] / 60:.1f} h of held-out evaluation (a run's start-up and the seeds' cold "
                 "starts besides); per run in the last table.", "",
                 f"Held-out Pass@1 over {q} questions x {k} samples and seeds {', '.join(map(str, seeds))}: mean and "
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
    if res.get("types"):
        intervals += ["", "By question type (" + ", ".join(f"{n} {t}" for t, n in res["types"].items()) + "):", "",
                      "| | type | start | after training | after − start | AEPO − this method |", "|---|---|---|---|---|---|"]
        for a in names:
            for t, row in res["algos"][a].get("by_type", {}).items():
                own = ci(res["start_by_type"][t]) if "start_by_type" in res and a not in OWN_START else "–"
                intervals.append(f"| {NAMES[a]} | {t} | {own} | {ci(row['pass@1'])} | "
                                 f"{ci(row['gain']) if 'gain' in row else '–'} | "
                                 f"{ci(row['aepo_minus']) if 'aepo_minus' in row else '–'} |")
        intervals += ["", *mechanism_table(res, names)]
    if "start_format_valid" in res:
        intervals += ["", f"Format valid (the share of held-out samples in the agent's format, which the reward scores "
                      f"beside the answer) at the start: {ci(res['start_format_valid'])}."]
    lines = [*intervals, "", f"Mean ± sd over seeds {', '.join(map(str, seeds))} (per-seed values in brackets). Start (the "
             f"cold-started model every run of a seed begins from): held-out Pass@1 "
             f"{mean_sd(before)[0]:.3f} ± {mean_sd(before)[1]:.3f}." if before else "", "",
             f"| | Pass@1 after | Pass@{k} after | train reward (2nd half) | entropy step 1 → last 3 | diversity: answers "
             "/ tokens / tool calls | tool calls / traj | clip hi / lo | grad kept / dropped | searches run | s / step |"
             " probe entropy step 1 → last (change) | branches / question, share on the top chain | min: training, "
             "evaluation |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in names:
        lines.append(f"| {NAMES[a]} | {cell(a, 'pass@1', seeds_too=True)} | {cell(a, f'pass@{k}')} "
                     f"| {cell(a, 'train_reward_2nd_half')} | {cell(a, 'entropy_first', '{:.2f}')} → "
                     f"{cell(a, 'entropy_last_3', '{:.2f}')} | {cell(a, 'diversity_answers', '{:.2f}')} / "
                     f"{cell(a, 'diversity_tokens', '{:.2f}')} / {cell(a, 'diversity_tool_seqs', '{:.2f}')} "
                     f"| {cell(a, 'tool_calls', '{:.2f}')} | {cell(a, 'clip_hi', '{:.4f}')} / "
                     f"{cell(a, 'clip_lo', '{:.4f}')} | {cell(a, 'grad_kept', '{:.4f}')} / "
                     f"{cell(a, 'grad_dropped', '{:.4f}')} | {cell(a, 'searches_executed', '{:.0f}')} "
                     f"| {cell(a, 'step_s', '{:.0f}')} | {probe(a)} | {branching(a)} | "
                     f"{cell(a, 'train_min', '{:.0f}')}, {cell(a, 'eval_min', '{:.1f}')} |")
    lines += ["", "Entropy step 1 → last 3: the entropy of the tokens each step sampled (it moves with the questions "
              "drawn and with what the tree samples). Probe entropy: the policy's own entropy, teacher-forced on the "
              "same few trajectories at every step; each run samples its probe once from its start, so compare the "
              "change, not the level."]
    return "\n".join(lines) + "\n"


def mechanism_table(res: dict, names: list[str]) -> list[str]:
    """The paper's mechanisms, per method (mean ± sd over seeds), by question type where they act."""
    kinds = list(res["types"])

    def cell(a, key, fmt="{:.2f}"):
        stats = res["algos"][a]["mean_sd"].get(key)
        return "–" if stats is None else f"{fmt.format(stats[0])} ± {fmt.format(stats[1])}"

    def per_kind(a, key, fmt="{:.2f}"):
        return " / ".join(cell(a, f"{key}/{t}", fmt) for t in kinds)
    head = " / ".join(kinds)
    lines = ["Mechanisms (mean ± sd over seeds; by type in the order " + head + "): informative groups are a step's "
             "questions whose rewards are not all equal (the only ones with an advantage); branches per question are "
             "the trajectories a tree forked off; m is the pre-monitor's global samples per question (k without the "
             "dynamic budget); the top chain's share is of a branched tree's branches; kept / dropped are the shares "
             "of tokens the clip kept a gradient for and dropped; the probe's change is its entropy at the last step "
             "less the first's; searches per correct answer are held-out search calls over correct samples; then "
             "held-out searches per sample, and the share of samples that searched as often as their type needs.", "",
             f"| | informative groups / step ({head}) | share of groups informative | branches / question | m / question "
             "| branches on the top chain | grad kept / dropped | probe entropy change | searches per correct answer "
             f"(all; {head}) | held-out searches / sample | searching as often as needed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in names:
        lines.append(f"| {NAMES[a]} | {per_kind(a, 'informative')} | {per_kind(a, 'informative_share')} | "
                     f"{per_kind(a, 'branches')} | {per_kind(a, 'm', '{:.1f}')} | {cell(a, 'top_chain')} | "
                     f"{cell(a, 'grad_kept', '{:.4f}')} / {cell(a, 'grad_dropped', '{:.4f}')} | "
                     f"{cell(a, 'probe_change', '{:.3f}')} | {cell(a, 'searches_per_correct/all')} "
                     f"({per_kind(a, 'searches_per_correct')}) | {per_kind(a, 'searches')} | "
                     f"{per_kind(a, 'as_needed')} |")
    return lines


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
              "pass1": [("pass@1", "held-out Pass@1"), ("format_valid", "held-out samples in the agent's format")],
              "types": [(f"type/{t}/{m}", f"{t}: {label}") for m, label in (
                  ("acc", "training success"), ("searches", "searches / trajectory")) for t in SEARCHES]
              }.get(key, [(key, title)])
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (metric, label) in zip(axes.flat, panels):
        starts = [runs[names[0], s]["eval"].get("before", {}).get(metric) for s in seeds]   # the seed's shared start
        for a in names:
            if key == "pass1":
                if any(metric not in runs[a, s]["eval"]["after"] for s in seeds):
                    continue                                             # summaries from before the key
                curves = [pass1_curve(runs[a, s], len(runs[a, s]["metrics"]), args.eval_every, metric)
                          for s in seeds]
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
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (each seed: one run per method)")
    parser.add_argument("--only", default="algorithms", choices=["all", "algorithms", "experiments"],
                        help="the algorithms (GRPO, ARPO, AEPO unless --methods names others), the entropy-fall "
                        "experiments, or both")
    parser.add_argument("--work", default=str(ROOT / "runs" / "compare"), help="task files, run directories, logs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare"), help="report directory")
    parser.add_argument("--methods", default="", help="comma-separated: these of --only's methods (e.g. "
                        "grpo,dapo,aepo or aepo-norollout; default GRPO, ARPO, AEPO and every experiment)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--backend", default="vllm" if importlib.util.find_spec("vllm") else "transformers",
                        choices=["vllm", "transformers"], help="generation backend (default: vLLM when installed)")
    parser.add_argument("--config", default="configs/learn.yaml", help="the setting every run starts from")
    for key in TUNABLE:
        parser.add_argument(f"--{key}", type=float if key == "lr" else int, default=None,
                            help="train.py's (default: --config's)")
    parser.add_argument("--max_tool_calls", type=int, default=None, help="train.py's (default: 3, one per hop, with "
                        "three-hop questions; --config's without)")
    parser.add_argument("--three_hop_every", type=int, default=3, help="every n-th RL and held-out question is "
                        "three-hop (data/build_lookup.py; 0: none)")
    parser.add_argument("--three_hop_demos", type=int, default=3, help="three-hop demonstrations among the cold "
                        "start's 24 (bench/results/gate/)")
    parser.add_argument("--eval_limit", type=int, default=150, help="held-out questions (the types in turn)")
    parser.add_argument("--eval_n", type=int, default=2, help="samples per held-out question (Pass@1 and Pass@n)")
    parser.add_argument("--eval_every", type=int, default=0, help="held-out evaluation every N steps too (a Pass@1 "
                        "curve; 0: before and after only)")
    parser.add_argument("--report_only", action="store_true", help="only aggregate the finished runs in --work")
    return parser


def chosen_reports(args: argparse.Namespace) -> dict[str, tuple[list[str], Path]]:
    """{report: (its methods, its folder)} for --only and --methods; ValueError names a method --only does not have."""
    reports = {"algorithms": (list(ALGOS) if args.methods else list(MAIN), Path(args.out)),
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
    task = make_task(Path(args.work) / "task", n_test=max(200, args.eval_limit), three_hop_every=args.three_hop_every,
                     three_hop_demos=args.three_hop_demos if args.three_hop_every else 0)
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
