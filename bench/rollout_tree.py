"""Tree rollout vs. k independent samples on the same prompts and budget (AEPO, arXiv:2510.14545, paper §3.2).

For the same questions, k and seed, runs `rollout.tree_rollout` three ways -- AEPO (dynamic budget +
branching with the penalty), ARPO-style branching (m = k/2, λ = 0) and k independent samples (GRPO) --
and prints, per trajectory: generated (decoded) tokens, tool calls, response tokens; per rollout: wall
time, branches per tree, and the share of context tokens a prefix cache would reuse
(`shared_prefix_frac`; only reuse at the start of a trajectory is counted: the prompt for every global
sample after the first, prompt + forked prefix for a branch).

The policy must call tools for the tree to branch: by default this loads the cold-started embedded
model that `train.py` caches (run `python train.py` once, or pass --model DIR); with --model raw it
uses the embedded model without cold start (it rarely calls tools, so the tree degenerates).

    python bench/rollout_tree.py                      # 8 questions of data/qa_test.jsonl, k = 8
    python bench/rollout_tree.py --questions 16 --k 12 --model runs/x/checkpoints/latest
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import models
from harness import dataset  # noqa: E402
from harness import generation  # noqa: E402
import reward  # noqa: E402
import rollout  # noqa: E402
from harness import search as search_mod  # noqa: E402
import tools  # noqa: E402


def load_policy(spec: str):
    """(model, tokenizer): 'cold' = the newest cold-started embedded model in the cache, 'raw' = the embedded
    model as shipped, else a model directory."""
    import os
    cache = Path(os.environ.get("AEPO_CACHE") or Path.home() / ".cache" / "aepo")
    if spec == "cold":
        found = sorted((p for p in (cache / "cold_start").glob("*") if (p / "config.json").exists()),
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise SystemExit(f"no cold-started model under {cache}/cold_start: run `python train.py` once "
                             "(it caches one) or pass --model DIR")
        path = str(found[-1])
    elif spec == "raw":
        path = str(models.embedded_model_dir(cache))
    else:
        path = spec
    return models.load_lm(path, torch.device("cpu")), models.load_tokenizer(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cold", help="'cold' (cached cold-started embedded model), 'raw', or a path")
    ap.add_argument("--data", default=str(ROOT / "data" / "qa_test.jsonl"))
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max_response_tokens", type=int, default=256, help="as train.py's embedded default")
    ap.add_argument("--search_topk", type=int, default=1, help="snippets per search (train.py's embedded default)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_policy(args.model)
    rows = dataset.load_dataset(args.data)[:args.questions]
    prompts = [tools.build_prompt(tokenizer, r["question"]) for r in rows]
    runner = tools.Tools(search_mod.make_search("bm25", topk=args.search_topk))
    gen = generation.TransformersGenerator(model, tokenizer)
    variants = {
        "aepo": dict(),
        "arpo": dict(dynamic_budget=False, lam=0.0),
        "independent": dict(entropy_branching=False),
    }
    results = {}
    for name, kw in variants.items():
        t0 = time.perf_counter()
        trajs, stats = rollout.tree_rollout(prompts, gen, runner, tokenizer, k=args.k, seed=args.seed,
                                            sampling=rollout.Sampling(temperature=args.temperature),
                                            max_response_tokens=args.max_response_tokens, **kw)
        wall = time.perf_counter() - t0
        rewards = [reward.deep_research_reward(t.text, rows[t.group_id]["golds"]) for t in trajs]
        n, q = stats["trajectories"], stats["questions"]                  # tree_stats gives sums and counts
        results[name] = dict(
            wall_s=round(wall, 1), s_per_traj=round(wall / n, 2),
            generated_tokens_per_traj=round(stats["gen_len"] / n, 1),
            decoded_tokens_total=sum(sum(t.loss_mask[t.fork_offset:]) for t in trajs),
            response_tokens_per_traj=round(stats["resp_len"] / n, 1),
            tool_calls_per_traj=round(stats["tool_calls"] / n, 2),
            executed_search_calls=stats.get("tools/search/calls", 0),
            m=round(stats["m"] / q, 2), branches_per_tree=round(stats["branches"] / q, 2),
            shared_prefix_frac=round(stats["shared_prefix"] / stats["seq_len"], 3),
            mean_reward=round(sum(rewards) / len(rewards), 3))
        print(name, json.dumps(results[name]), flush=True)
    runner.close()
    a, i = results["aepo"], results["independent"]
    print(f"rollout_tree model={args.model} q={len(rows)} k={args.k}: "
          f"tree {a['wall_s']}s vs independent {i['wall_s']}s (x{a['wall_s'] / max(i['wall_s'], 1e-9):.2f}) | "
          f"decoded tokens {a['decoded_tokens_total']} vs {i['decoded_tokens_total']} | "
          f"tool calls/traj {a['tool_calls_per_traj']} vs {i['tool_calls_per_traj']} | "
          f"prefix reuse {a['shared_prefix_frac']:.1%} vs {i['shared_prefix_frac']:.1%} | "
          f"branches/tree {a['branches_per_tree']} m {a['m']} | reward {a['mean_reward']} vs {i['mean_reward']}")


if __name__ == "__main__":
    main()
