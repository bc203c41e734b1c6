"""The gate before RL on the lookup task: can the cold-started policy reach a two-hop answer at all?

RL sharpens what sampling already reaches; it does not invent from zero. So before training, each cold start (d
two-hop demonstrations among its 24, and its steps / batch / learning rate) is sampled the way RL samples: k = 8
independent trajectories per question at temperature 1 and the learning setting's token budget, on RL-pool questions
of each type (lookup, two_hop, and three_hop where the variant's task has them; data/build_lookup.py). Per type:
Pass@1, Pass@8, the share in format, with >= 2 and >= 3 searches, truncated, and (two- and three-hop) answering the
director's name instead of the passphrase. The cold start to train from is one where two-hop Pass@1 is about 0.05-0.20
and Pass@8 >= 0.4: something for RL to amplify. The t variants ask the same of three-hop questions (a third of the RL
pool, bench/compare_algorithms.py's task) with t three-hop demonstrations among the 24.

    .venv-vllm/bin/python bench/gate.py                           # every variant below -> bench/results/gate/
    .venv-vllm/bin/python bench/gate.py --variants d12-s8,d12-s24 # some of them
    python bench/gate.py --report_only                             # the table again from the finished variants

Each variant runs in a process of its own (its cold start is cached like a run's), writes <work>/<variant>.json and
is reused when that file is there; the report is results.md and results.json under --out.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))
from build_lookup import DEFAULT, make_task  # noqa: E402
from reward import pass_at_k  # noqa: E402

LEARN_D = DEFAULT["two_hop_demos"]
# name -> (two-hop demonstrations d, cold-start steps, batch, learning rate[, three-hop demonstrations t: the task then
# has every third RL-pool question three-hop])
VARIANTS = {"d12-s8": (12, 8, 3, 5e-5), "d12-s24": (12, 24, 3, 5e-5), "d6-s24": (6, 24, 3, 5e-5),
            "d3-s24": (3, 24, 3, 5e-5), "d2-s24": (2, 24, 3, 5e-5), "d1-s24": (1, 24, 3, 5e-5),
            "d0-s24": (0, 24, 3, 5e-5), "d3-t0-s24": (3, 24, 3, 5e-5, 0), "d3-t3-s24": (3, 24, 3, 5e-5, 3),
            "d3-t6-s24": (3, 24, 3, 5e-5, 6)}
KINDS = ("lookup", "two_hop", "three_hop")


def task_of(name: str, work: Path) -> dict:
    """The variant's lookup task (built under work/tasks/)."""
    d, *_, t = VARIANTS[name] if len(VARIANTS[name]) == 5 else (*VARIANTS[name], None)
    if t is None:
        return make_task(work / "tasks" / f"d{d}", two_hop_demos=d)
    return make_task(work / "tasks" / f"d{d}-t{t}", two_hop_demos=d, three_hop_demos=t, three_hop_every=3)


def variant_argv(name: str, task: dict, args) -> list[str]:
    d, steps, batch, lr = VARIANTS[name][:4]
    return ["--train_data", task["train"], "--eval_data", "", "--search", "bm25",
            "--search_kw", json.dumps({"corpus_path": task["corpus"], "topk": 1}),
            "--cold_start_kw", json.dumps({"questions": 24, "steps": steps, "batch": batch, "lr": lr}),
            "--backend", args.backend, "--device", "cpu", "--seed", str(args.seed), "--steps", "1",
            "--max_response_tokens", str(args.max_response_tokens), "--out_dir", str(Path(args.work) / "runs"),
            "--run_name", name]


def sample_one(argv: list[str], per_type: int, k: int) -> dict:
    """Cold-start (or load the cached cold start), then k samples at temperature 1 of `per_type` RL-pool questions of
    each type; per-question counts."""
    import torch
    import reward
    import rollout
    from harness import config, generation
    from harness.run import rundir
    from harness.run.startup import set_up
    cfg = config.parse_config(argv)
    run = set_up(cfg, 0, 1, torch.device("cpu"), rundir.RunState(), reward.score_response,
                 generation.make_generator)
    rows = []
    for kind in KINDS:
        rows += [r for r in run.train_rows if r["meta"]["type"] == kind][:per_type]
    tree = rollout.TreeSettings(k=k, dynamic_budget=False, entropy_branching=False,
                                max_tool_calls=cfg.max_tool_calls, max_response_tokens=cfg.max_response_tokens)
    out, started = [], time.time()
    for s in range(0, len(rows), 10):
        chunk = rows[s:s + 10]
        with torch.no_grad(), run.amp():
            trajectories, _ = rollout.tree_rollout([run.tools.format.build_prompt(run.tokenizer, r["question"])
                                                    for r in chunk], run.generator, run.tools, run.tokenizer, tree,
                                                   sampling=rollout.Sampling(1.0, 1.0), seed=cfg.seed + s)
        for g, row in enumerate(chunk):
            mine = [t for t in trajectories if t.group_id == g]
            scores = [run.score(t.text, row["golds"]) for t in mine]
            bridge = reward.normalize_answer(row["meta"].get("bridge", "")) or None
            out.append({"type": row["meta"]["type"], "question": row["question"], "k": len(mine),
                        "correct": int(sum(s["em"] for s in scores)),
                        "format_ok": sum(s["format_valid"] for s in scores),
                        "two_searches": sum(sum(c[0] == "search" for c in t.tool_calls) >= 2 for t in mine),
                        "three_searches": sum(sum(c[0] == "search" for c in t.tool_calls) >= 3 for t in mine),
                        "searches": sum(sum(c[0] == "search" for c in t.tool_calls) for t in mine),
                        "truncated": sum(bool(t.truncated) for t in mine),
                        "bridge": sum(bridge is not None and reward.normalize_answer(s["prediction"] or "") == bridge
                                      for s in scores),
                        "example": mine[0].text[:1500]})
    run.generator.close()
    return {"questions": out, "sample_s": round(time.time() - started, 1)}


def summary(result: dict, k: int) -> dict:
    """Per type: Pass@1, Pass@k and the shares, as means over questions (each question's k samples)."""
    out = {}
    for kind in [k for k in KINDS if any(q["type"] == k for q in result["questions"])]:
        qs = [q for q in result["questions"] if q["type"] == kind]
        n = sum(q["k"] for q in qs)
        out[kind] = {"questions": len(qs), "pass@1": sum(q["correct"] for q in qs) / n,
                     f"pass@{k}": sum(pass_at_k(q["k"], int(q["correct"]), k) for q in qs) / len(qs),
                     **{key: sum(q[key] for q in qs) / n
                        for key in ("format_ok", "two_searches", "three_searches", "truncated", "bridge", "searches")
                        if all(key in q for q in qs)}}
    return out


def report(done: dict, args) -> str:
    k = args.k
    dates = sorted({r.get("date", "2026-12-06") for r in done.values()})      # (the first variants: that day)
    lines = [f"# The gate: cold starts sampled as RL samples ({', '.join(dates)})", "",
             f"{args.per_type} RL-pool questions per type x k = {k} at temperature 1, {args.max_response_tokens} "
             f"response tokens, BM25 top-1, seed {args.seed}; backend "
             f"{', '.join(sorted({r['backend'] for r in done.values()}))}. d = two-hop demonstrations among "
             "the cold start's 24; t = three-hop ones (t variants: every third RL-pool question is three-hop); s = "
             "cold-start steps of 3 demonstrations. Shares are of samples.", "",
             f"| variant | d | t | steps | lr | type | Pass@1 | Pass@{k} | in format | >= 2 searches | >= 3 searches "
             "| searches | truncated | answers the director | cold start + sampling |", "|" + "---|" * 15]
    for name, result in done.items():
        d, steps, batch, lr = VARIANTS[name][:4]
        t = VARIANTS[name][4] if len(VARIANTS[name]) == 5 else "–"
        for kind, s in summary(result, k).items():
            three = f"{s['three_searches']:.2f}" if "three_searches" in s else "–"      # (the first variants: none)
            lines.append(f"| {name} | {d} | {t} | {steps} | {lr:g} | {kind} | {s['pass@1']:.3f} | "
                         f"{s[f'pass@{k}']:.2f} | {s['format_ok']:.2f} | {s['two_searches']:.2f} | {three} | "
                         f"{s['searches']:.2f} | {s['truncated']:.2f} | "
                         f"{s['bridge'] if kind != 'lookup' else float('nan'):.2f} | {result['wall_s']:.0f} s |")
    two_hop = {name: summary(result, k)["two_hop"] for name, result in done.items()}
    three_hop = {name: s["three_hop"] for name, s in ((n, summary(r, k)) for n, r in done.items()) if "three_hop" in s}
    fit = [name for name, s in two_hop.items() if 0.05 <= s["pass@1"] <= 0.25 and s[f"pass@{k}"] >= 0.4]
    lines += ["", f"Something for RL to amplify (two-hop Pass@1 about 0.05-0.20, here 0.05-0.25, and Pass@{k} >= 0.4): "
              f"{', '.join(fit) or 'none'}. configs/learn.yaml trains from d = {LEARN_D} (data/lookup/train.jsonl: "
              f"data/build_lookup.py's two_hop_demos) with 24 cold-start steps."]
    if three_hop:
        reach = [name for name, s in three_hop.items() if s["pass@1"] >= 0.05 and s[f"pass@{k}"] >= 0.4]
        lines += ["", f"Three-hop reachable by the same rule (Pass@1 >= 0.05, Pass@{k} >= 0.4): {', '.join(reach) or 'none'}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--per_type", type=int, default=20, help="RL-pool questions per type")
    parser.add_argument("--k", type=int, default=8, help="samples per question")
    parser.add_argument("--max_response_tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="vllm" if importlib.util.find_spec("vllm") else "transformers")
    parser.add_argument("--work", default="/tmp/aepo_gate")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gate"))
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)           # (internal) one variant, in its own process
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    if unknown := [n for n in names if n not in VARIANTS]:
        parser.error(f"--variants: unknown {', '.join(unknown)}; the variants are {', '.join(VARIANTS)}")
    work = Path(args.work)
    if args.one:
        task = task_of(args.one, work)
        shutil.rmtree(work / "runs" / args.one, ignore_errors=True)        # a failed try's folder
        started = time.time()
        result = sample_one(variant_argv(args.one, task, args), args.per_type, args.k)
        result.update(wall_s=round(time.time() - started, 1), backend=args.backend, date=time.strftime("%Y-%m-%d"))
        (work / f"{args.one}.json").write_text(json.dumps(result))
        return
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "2"}
    for name in names if not args.report_only else []:
        if (work / f"{name}.json").exists():
            continue
        work.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
        with open(work / f"{name}.log", "w") as log:
            if subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"{name} failed: see {work / f'{name}.log'}")
        print(f"{name}: done", flush=True)
    done = {n: json.loads((work / f"{n}.json").read_text()) for n in names if (work / f"{n}.json").exists()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(report(done, args))
    (out / "results.json").write_text(json.dumps({n: {"variant": VARIANTS[n], "wall_s": r["wall_s"],
                                                      "by_type": summary(r, args.k)} for n, r in done.items()},
                                                 indent=1))
    print(report(done, args))


if __name__ == "__main__":
    main()
