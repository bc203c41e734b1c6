"""Rollout trees, recorded and drawn: one record per question of every training step (and of every evaluation), and
how diverse each question's group is.

In the tree of paper §3.2 (its Figure 2) the
pre-monitor sets how many of the k trajectories are global samples (m), the others branch off after tool calls whose
segment entropy rose, and the consecutive-branch penalty keeps the branches from piling onto one chain. A record
keeps the shape of one question's tree without its text (samples.jsonl has texts): per trajectory its parent, the
token offset of its fork, its kind, its l, the token span and H_seg of every segment it generated, its tool calls
(tool and the first 60 characters of the argument), why it ended, its reward and its length.

    python -m harness.trees runs/<name>            # the last step's trees -> runs/<name>/trees_step_N.png
    python -m harness.trees runs/<name> --step 3 --out t.png
    python -m harness.trees runs/<name> --eval after  # the trees of evaluation 'after' (k independent samples)

The official code logs no trees; this is for reading the rollout, and changes nothing in it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from harness import jsonl

ARG_CHARS = 60                                     # a tool call's argument is kept to this many characters
KINDS = {"premonitor": ("o", "pre-monitor"), "global": ("s", "global sample"), "branch": ("^", "branch"),
         "completion": ("D", "completion")}


def spans(loss_mask: list[int]) -> list[list[int]]:
    """[start, end) token offsets of the runs of policy tokens (mask 1): the segments the policy generated."""
    out, start = [], None
    for i, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append([start, i])
            start = None
    return out


def records(step, rows: list[dict], trajectories, m_per_question: list, rewards) -> list[dict]:
    """One record per question of a rollout (trajectories ordered by question, as tree_rollout returns them)."""
    out = [{"step": step, "question_id": row.get("id", str(g)), "question": row["question"][:100],
            "m": m_per_question[g], "k": 0, "prompt_tokens": 0, "trajectories": []} for g, row in enumerate(rows)]
    for t, r in zip(trajectories, [float(x) for x in rewards]):
        rec = out[t.group_id]
        rec["k"] += 1
        rec["prompt_tokens"] = len(t.prompt_ids)
        rec["trajectories"].append({
            "id": t.traj_id, "parent": t.parent, "fork": t.fork_offset, "kind": t.kind, "round": t.round,
            "l": t.l, "branch_l": list(t.branch_l), "segments": spans(t.loss_mask),
            "h_seg": [round(h, 4) for h in t.seg_entropies],
            "tools": [[tool, arg[:ARG_CHARS]] for tool, arg in t.tool_calls],
            "finish": t.finish_reason, "reward": round(r, 4), "length": len(t.response_ids)})
    return out



def diversity(trajectories, scores) -> dict[str, float]:
    """Rollout diversity of this rank's groups, summed over questions (step_metrics divides by the questions):
    answers: distinct normalised predictions / k (no prediction counts as one answer); tool_seqs: distinct sequences
    of tool calls (tool and argument) / k; tokens: mean over pairs of 1 − Jaccard similarity of the sets of policy
    token bigrams (0: the k trajectories wrote the same bigrams, 1: no bigram in common)."""
    from reward import normalize_answer
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault(t.group_id, []).append(i)
    out = {"answers": 0.0, "tool_seqs": 0.0, "tokens": 0.0}
    for idx in groups.values():
        k = len(idx)
        answers = {normalize_answer(scores[i]["prediction"]) if scores[i]["prediction"] is not None else None
                   for i in idx}
        out["answers"] += len(answers) / k
        out["tool_seqs"] += len({tuple(trajectories[i].tool_calls) for i in idx}) / k
        bigrams = [_policy_bigrams(trajectories[i]) for i in idx]
        pairs = [(a, b) for n, a in enumerate(bigrams) for b in bigrams[n + 1:]]
        out["tokens"] += sum(1 - len(a & b) / max(1, len(a | b)) for a, b in pairs) / len(pairs) if pairs else 0.0
    return out


def _policy_bigrams(t) -> set[tuple[int, int]]:
    ids = [tok for tok, m in zip(t.response_ids, t.loss_mask) if m]
    return set(zip(ids, ids[1:]))


def append(path: Path, recs: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def load(path: Path, step: int | None = None) -> list[dict]:
    """The records of `step` in a trees.jsonl (default: its last step)."""
    text = Path(path).read_text(encoding="utf-8")
    recs = [json.loads(line) for line in jsonl.lines(text) if line.strip()]
    if not recs:
        raise ValueError(f"{path}: no tree records")
    step = recs[-1]["step"] if step is None else step
    chosen = [r for r in recs if r["step"] == step]
    if not chosen:
        raise ValueError(f"{path}: no trees of step {step} (steps {recs[0]['step']}..{recs[-1]['step']})")
    return chosen


def draw(recs: list[dict], out_png: Path, title: str = "") -> Path:
    """One panel per question: every trajectory a row of its tokens, the global samples from the root on the left,
    each branch leaving its parent's row at its fork; segments coloured by H_seg, tool calls marked where the
    segment ended with them, each leaf marked by its reward."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    cols = min(4, len(recs))
    rows_n = math.ceil(len(recs) / cols)
    heights = [max(r["k"] for r in recs[i * cols:(i + 1) * cols]) for i in range(rows_n)]
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.6 * cols, sum(1.3 + 0.3 * h for h in heights) + 0.6),
                             squeeze=False, gridspec_kw={"height_ratios": [h + 3 for h in heights]},
                             layout="constrained")
    h_max = max([h for r in recs for t in r["trajectories"] for h in t["h_seg"]] + [1e-6])
    norm, cmap = matplotlib.colors.Normalize(0.0, h_max), matplotlib.colormaps["viridis"]
    rcmap = matplotlib.colormaps["RdYlGn"]
    for ax, rec in zip(axes.flat, recs):
        _panel(ax, rec, norm, cmap, rcmap)
    for ax in list(axes.flat)[len(recs):]:
        ax.axis("off")
    bar = fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, fraction=0.02, pad=0.01)
    bar.set_label("segment entropy H_seg")
    handles = [Line2D([], [], marker=m, ls="", color="0.3", label=label) for m, label in KINDS.values()]
    handles += [Line2D([], [], marker="*", ls="", color=rcmap(1.0), ms=10, label="leaf: reward (red -1 .. green 1)"),
                Line2D([], [], marker="|", ls="", color="k", ms=10, label="tool call (S search, P python)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.savefig(out_png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(out_png)


def _panel(ax, rec, norm, cmap, rcmap) -> None:
    trajs = {t["id"]: t for t in rec["trajectories"]}
    order = _tree_order(rec["trajectories"])
    y = {tid: -row for row, tid in enumerate(order)}
    for tid in order:
        t = trajs[tid]
        parent = trajs.get(t["parent"])
        start = t["fork"] if parent is not None else 0
        if parent is not None:                               # the fork: from the parent's row down to this one
            ax.plot([start, start], [y[parent["id"]], y[tid]], color="0.6", lw=0.8, zorder=1)
        ax.plot([start, t["length"]], [y[tid], y[tid]], color="0.85", lw=1.0, zorder=1)   # tool results, gaps
        for (a, b), h in zip(t["segments"], t["h_seg"]):
            if b > start:
                ax.plot([max(a, start), b], [y[tid], y[tid]], color=cmap(norm(h)), lw=3.2, solid_capstyle="butt",
                        zorder=2)
        for (a, b), (tool, _) in zip(t["segments"], t["tools"]):
            if b > start:
                ax.text(b, y[tid] + 0.18, tool[0].upper(), fontsize=5.5, ha="center", va="bottom", zorder=3)
        marker = KINDS.get(t["kind"], ("s", ""))[0]
        ax.plot([start], [y[tid]], marker=marker, ms=3.5, color="0.3", zorder=3)
        ax.plot([t["length"]], [y[tid]], marker="*", ms=7, color=rcmap((t["reward"] + 1) / 2), zorder=3,
                markeredgecolor="0.2", markeredgewidth=0.3)
        ax.annotate(f"{t['reward']:+.2f}", (t["length"], y[tid]), xytext=(6, 0), textcoords="offset points",
                    fontsize=5.5, va="center")
    branches = sum(t["parent"] is not None for t in rec["trajectories"])
    ax.set_title(f"{rec['question_id']}: m {rec['m']}, {branches} branch(es), k {rec['k']}\n{rec['question'][:60]}",
                 fontsize=7)
    ax.set_yticks([])
    ax.set_xlabel("response tokens", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.set_ylim(-len(order) + 0.4, 0.7)
    ax.margins(x=0.08)


def _tree_order(trajectories: list[dict]) -> list[int]:
    """Depth-first: each global sample followed by its branches (and theirs), in creation order."""
    children: dict = {}
    for t in trajectories:
        children.setdefault(t["parent"], []).append(t["id"])
    out, stack = [], list(reversed(children.get(None, [])))
    while stack:
        tid = stack.pop()
        out.append(tid)
        stack += list(reversed(children.get(tid, [])))
    return out


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description="Draw a run's rollout trees (AEPO, arXiv:2510.14545) to a PNG",
                                     allow_abbrev=False)
    parser.add_argument("run", help="a training run folder (runs/<name>)")
    parser.add_argument("--step", type=int, default=None, help="the training step to draw (default: the last)")
    parser.add_argument("--eval", default="", help="draw the trees of this evaluation instead (e.g. before, after)")
    parser.add_argument("--out", default="", help="output PNG (default: in the run folder)")
    args = parser.parse_args(argv)
    run = Path(args.run)
    path = run / "eval" / f"{args.eval}_trees.jsonl" if args.eval else run / "trees.jsonl"
    try:
        if not path.exists():
            raise ValueError(f"{path} does not exist (runs record trees.jsonl; evaluations <name>_trees.jsonl)")
        recs = load(path, args.step)
    except ValueError as err:                    # one line, exit 2, like train.py and eval.py
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    what = f"evaluation {args.eval}" if args.eval else f"step {recs[0]['step']}"
    name = f"trees_{args.eval}.png" if args.eval else f"trees_step_{recs[0]['step']}.png"
    out = draw(recs, Path(args.out) if args.out else run / name, f"{run.name}: rollout trees of {what}")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
