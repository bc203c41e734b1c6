"""Branch spreading at the paper's k: do AEPO's rollout rules spread branches over more chains than ARPO's?

A simulation of the rollout rule on measured entropies, not a training run. The project's own
`rollout.tree_rollout` (unchanged: pre-monitor, global budget m, branching with the consecutive-branch penalty,
completion) drives a simulated policy with no model: each segment's H_seg is drawn from the segment entropies
measured on the embedded model's real rollouts (the first segment from the measured first segments, a segment after
a tool result from the measured post-tool segments: bench/results/segment_entropy.json), and a segment ends with a
tool call with a probability that depends on how many tool results its path already holds. Two tool-use profiles:
`measured` (the embedded model's own: about one search per trajectory) and `deep` (a call after each of the first
six segments with probability 0.8, up to the official limit of 6, as deep-research agents do).

Variants (algorithm.md §6): ARPO (λ = 0, dynamic_budget off: m = k/2), AEPO without the dynamic budget (λ = 0.05,
m = k/2) and AEPO (λ = 0.05, m from the pre-monitor); and, to show what the penalty does when it bites, AEPO with
λ = 0.5. Per variant and k (12 and 16, the official values), over
`--questions` questions: the share of a tree's branches that descend from its most-branched global sample (top-1
chain) and from its 3 most-branched (top-3), pooled over all trees; branches per tree; the distribution of l at the
branches; the distribution of m. Seconds to run.

    python bench/branch_concentration.py                  # 1,000 questions per cell; table and plot
    python bench/branch_concentration.py --measure runs/trees-example    # re-measure the entropies of a real run

Measuring (`--measure RUN`): the run's trees.jsonl and eval/*_trees.jsonl (trees.py records); only trajectories
that did not branch off another (so no segment counts twice) give segments.
"""
import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import rollout  # noqa: E402
import tools  # noqa: E402

MEASURED = ROOT / "bench" / "results" / "segment_entropy.json"
OUT = ROOT / "bench" / "results" / "branch_concentration"
VARIANTS = {"ARPO": dict(lam=0.0, dynamic_budget=False), "AEPO, fixed m": dict(lam=0.05, dynamic_budget=False),
            "AEPO": dict(lam=0.05, dynamic_budget=True),
            "AEPO, λ = 0.5 (sensitivity)": dict(lam=0.5, dynamic_budget=True)}
DEEP = {j: 0.8 for j in range(6)}                         # P(a tool call | j tool results on the path)


class Chars:
    """One token per character: the simulated policy writes text, the rollout needs token ids."""
    eos_token_id = pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids if i)


class SimulatedPolicy:
    """Segments whose H_seg is drawn from measured values and whose tool calls follow `p_call`; each request draws
    from its own seed (the round's seed and its place in the batch, like the vLLM backend), so a branch and its
    parent share their past and draw their futures independently."""
    vocab_size = 49152

    def __init__(self, h_root: list[float], h_post: list[float], p_call: dict[int, float]):
        self.h_root, self.h_post, self.p_call, self.tok = h_root, h_post, p_call, Chars()

    def generate(self, contexts, max_new_tokens, seed, sampling=None, on_step=None):
        out = []
        for i, (context, budget) in enumerate(zip(contexts, max_new_tokens)):
            rng = random.Random(seed * 1_000_003 + i)
            j = self.tok.decode(context).count("<result>")
            h = rng.choice(self.h_root if j == 0 else self.h_post)
            if rng.random() < self.p_call.get(j, 0.0):
                text, reason = f"<think> t{rng.randint(0, 999)} </think> <search> q{j} {rng.random():.3f} </search>", \
                    "tool"
            else:
                text, reason = "<think> done </think> <answer> \\boxed{x} </answer>", "answer"
            ids = self.tok.encode(text)[:budget]
            out.append(rollout.Segment(ids, reason if len(ids) == len(text) else "length", h, text[:len(ids)]))
        return out


class EchoTools:
    def run(self, calls):
        return [f"r {c.argument}" if isinstance(c, tools.ToolCall) else f"Error: {c.message}" for c in calls], {}


def simulate(measured: dict, profile: str, k: int, variant: str, questions: int, seed: int) -> dict:
    p_call = DEEP if profile == "deep" else {int(j): p for j, p in measured["p_call"].items()}
    policy = SimulatedPolicy(measured["h_root"], measured["h_post"], p_call)
    prompts = [Chars().encode(f"question {i}\n") for i in range(questions)]
    trajs, stats = rollout.tree_rollout(prompts, policy, EchoTools(), Chars(), k=k, max_tool_calls=6,
                                        max_response_tokens=100_000, seed=seed, **VARIANTS[variant])
    return summarize(trajs, stats, k)


def summarize(trajs, stats, k: int) -> dict:
    """Pooled shares of branches on each tree's 1 and 3 most-branched chains, and the distributions of l and m."""
    per_tree: dict[int, Counter] = {}
    root_of = {}
    for t in trajs:                                        # creation order: a parent precedes its branches
        key = (t.group_id, t.traj_id)
        root_of[key] = key if t.parent is None else root_of[(t.group_id, t.parent)]
        if t.parent is not None:
            per_tree.setdefault(t.group_id, Counter())[root_of[key]] += 1
    branches = sum(sum(c.values()) for c in per_tree.values())
    top = lambda n: sum(sum(sorted(c.values(), reverse=True)[:n]) for c in per_tree.values())   # noqa: E731
    l_hist = Counter({int(l): n for l, n in stats["branch_l_hist"].items()})
    m = stats["m_per_question"]
    return {"k": k, "questions": len(m), "branches_per_tree": branches / len(m),
            "top1_share": top(1) / branches if branches else 0.0, "top3_share": top(3) / branches if branches else 0.0,
            "trees_with_branches": len(per_tree), "l_hist": dict(sorted(l_hist.items())),
            "l_mean": sum(l * n for l, n in l_hist.items()) / max(1, sum(l_hist.values())),
            "m_mean": statistics.mean(m), "m_hist": dict(sorted(Counter(m).items()))}


def measure(run: Path) -> dict:
    """Segment entropies and tool-call rates of a real run's trees (see the module docstring)."""
    files = [run / "trees.jsonl"] + sorted((run / "eval").glob("*_trees.jsonl"))
    h_root, h_post, calls = [], [], Counter()
    for path in (f for f in files if f.exists()):
        for line in path.read_text().splitlines():
            for t in json.loads(line)["trajectories"]:
                if t["parent"] is not None or not t["h_seg"]:
                    continue
                h_root.append(t["h_seg"][0])
                h_post += t["h_seg"][1:]
                for j in range(len(t["h_seg"])):
                    calls[(j, j < len(t["tools"]))] += 1
    p_call = {j: calls[(j, True)] / (calls[(j, True)] + calls[(j, False)]) for j in sorted({j for j, _ in calls})}
    return {"made_by": f"python bench/branch_concentration.py --measure {run}",
            "source": [str(f.resolve().relative_to(ROOT)) if f.resolve().is_relative_to(ROOT) else str(f)
                       for f in files if f.exists()],
            "h_root": h_root, "h_post": h_post, "p_call": p_call,
            "summary": {"segments": len(h_root) + len(h_post), "h_root_mean": statistics.mean(h_root),
                        "h_post_mean": statistics.mean(h_post) if h_post else None}}


def plot(results: list[dict], out_png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    profiles = sorted({r["profile"] for r in results})
    short = {"ARPO": "ARPO", "AEPO, fixed m": "AEPO\nfixed m", "AEPO": "AEPO", "AEPO, λ = 0.5 (sensitivity)": "AEPO\nλ 0.5"}
    fig, axes = plt.subplots(1, len(profiles), figsize=(7 * len(profiles), 3.8), squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        rows = [r for r in results if r["profile"] == profile]
        labels = [f"{short[r['variant']]}\nk={r['k']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["top1_share"] for r in rows], 0.4, label="top-1 chain")
        ax.bar([i + 0.2 for i in x], [r["top3_share"] for r in rows], 0.4, label="top-3 chains")
        for i, r in zip(x, rows):
            ax.text(i, 1.02, f"{r['branches_per_tree']:.1f} br.", ha="center", fontsize=7)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylim(0, 1.12)
        ax.set_ylabel("share of a tree's branches")
        ax.set_title(f"tool use: {profile}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Simulation of the rollout rule on measured segment entropies (no model)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=1000, help="questions (trees) per variant and k")
    parser.add_argument("--ks", default="12,16", help="budgets k to simulate (the official 12 and 16)")
    parser.add_argument("--seed", type=int, default=0, help="rollout seed (the numbers are exact for a seed)")
    parser.add_argument("--measure", default="", help="a run folder: measure its segment entropies into "
                                                      f"{MEASURED.relative_to(ROOT)} and stop")
    parser.add_argument("--out", default=str(OUT), help="folder for results.json, results.md and the plot")
    args = parser.parse_args()
    if args.measure:
        data = measure(Path(args.measure))
        MEASURED.write_text(json.dumps(data, indent=1))
        print(f"wrote {MEASURED}: {data['summary']}, P(call | j results) {data['p_call']}")
        return
    measured = json.loads(MEASURED.read_text())
    started, results = time.time(), []
    for profile in ("measured", "deep"):
        for k in (int(x) for x in args.ks.split(",")):
            for variant in VARIANTS:
                results.append({"profile": profile, "variant": variant,
                                **simulate(measured, profile, k, variant, args.questions, args.seed)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    head = ("| tool use | k | variant | branches / tree | top-1 chain | top-3 chains | mean l at a branch | "
            "l = 0 / 1 / 2 / ≥3 | m: mean (range) |")
    lines = [head, "|---" * 9 + "|"]
    for r in results:
        n = max(1, sum(r["l_hist"].values()))
        ls = [r["l_hist"].get(i, 0) / n for i in range(3)] + [sum(v for l, v in r["l_hist"].items() if l >= 3) / n]
        m_range = f"{min(r['m_hist'])}-{max(r['m_hist'])}"
        lines.append(f"| {r['profile']} | {r['k']} | {r['variant']} | {r['branches_per_tree']:.2f} | "
                     f"{r['top1_share']:.3f} | {r['top3_share']:.3f} | {r['l_mean']:.2f} | "
                     f"{' / '.join(f'{x:.2f}' for x in ls)} | {r['m_mean']:.2f} ({m_range}) |")
    table = "\n".join(lines) + "\n"
    (out / "results.md").write_text(table)
    plot(results, out / "branch_concentration.png")
    print(table + f"{len(results)} cells x {args.questions} questions in {time.time() - started:.1f} s; "
          f"results in {out}")


if __name__ == "__main__":
    main()
