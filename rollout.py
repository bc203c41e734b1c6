"""Dynamic entropy-balanced tree rollout: the pre-monitor sets the global budget m, branching after tool calls
spends the rest, with a penalty on consecutive branches.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3.2; algorithm.md §1
(segment entropy) and §2 (the rollout). Each question gets a budget of k trajectories. One pre-monitor trajectory
measures how uncertain the policy is at the start (H_root) and after tool results (H_tool); that sets how many of
the k are independent global samples (m) and how many come from branching the tree after tool calls whose segment
entropy rose, with a penalty that stops one chain from taking every branch. The generator and the tools are passed
in (`sampler.Generator`, `tools.Tools`), so the rollout runs with a scripted model and fake tools (tests/fakes.py);
this file copies with rounds.py, sampler.py and tools.py. Each tree moves at its own pace (rounds.py,
algorithm.md §2e).

Deviations from the paper / official code (algorithm.md §8): D1 (one pre-monitor, kept as a global sample), D2
(H_tool over its post-tool segments), D3 (m rounded up; no pre-monitor without the dynamic budget), D4 (the
consecutive-branch count per path, fresh every step), D5 (a branch's ΔH reference is its path's first segment), D6
(the pre-monitor's branching decisions taken when it finishes), D7 (groups completed with fresh samples, all at once,
never branching), D10 (a notice at the tool-call limit; `tool_limit_ends` does what the official code does), D11
(malformed calls are `Error:` observations; no branching decision follows one, nor the notice, as officially).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rounds import Rounds
from sampler import Generator, Sampling, Segment, request_seed  # noqa: F401 (Segment: imported from here)

# --------------------------------------------------------------------------------------------------
# The three formulas (algorithm.md §1, §2a, §2b)


def segment_entropy(topk_logprobs: list[list[float]], vocab_size: int, n: int = 20) -> float:
    """Eq.: H_seg = (1 / log|V|) · Σ_{j<n} Σ_{c ∈ topk_j} −exp(l_c)·l_c  (a sum over positions).

    topk_logprobs: one list per generated position of the top-k log-probs (k = 10) returned for it,
    not renormalised. Only the first n positions count; a shorter segment sums what it has.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    total = 0.0
    for position in topk_logprobs[:n]:
        total += sum(-math.exp(lp) * lp for lp in position if lp > -math.inf)
    return total / math.log(vocab_size)


def global_budget(k: int, h_root: float, h_tool: float, beta: float = 0.5) -> int:
    """Eq.: m = clip(ceil(k · σ(β·(H_root − H_tool))), 1, k): the number of global samples."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    x = beta * (h_root - h_tool)
    sigma = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))  # no overflow
    return min(k, max(1, math.ceil(k * sigma - 1e-9)))  # 1e-9: k·σ that is an integer in exact math


def branch_probability(u: float, delta_h: float, l: int, gamma: float = 0.2, lam: float = 0.05) -> float:
    """Eq.: P_t = (u + γ·ΔH_t) · (1 − min(1, λ·l)); the caller branches iff P_t ≥ τ.

    u ~ U(0,1); delta_h = H_seg(latest segment) − H_seg(first segment of this path);
    l = consecutive branch-creating tool steps on this path.
    """
    return (u + gamma * delta_h) * (1.0 - min(1.0, lam * l))


def premonitor_budget(premonitor: "Trajectory", k: int, beta: float = 0.5) -> int:
    """algorithm.md §2a: m from a finished pre-monitor, H_root its first segment's entropy, H_tool the mean over its
    segments that follow a tool result (H_root when it called no tool)."""
    h_root = premonitor.seg_entropies[0]
    after_tool = premonitor.seg_entropies[1:]
    h_tool = sum(after_tool) / len(after_tool) if after_tool else h_root
    return global_budget(k, h_root, h_tool, beta)


# --------------------------------------------------------------------------------------------------
# The tree (algorithm.md §2)


@dataclass(frozen=True)
class TreeSettings:
    """The rollout's settings (algorithm.md §2; the paper's defaults)."""
    k: int = 16                       # trajectories per question
    beta: float = 0.5                 # pre-monitor slope of m (§2a)
    gamma: float = 0.2                # branch weight of ΔH (§2b)
    lam: float = 0.05                 # consecutive-branch penalty P̂(l) = min(1, λ·l)
    tau: float = 0.5                  # branch threshold
    dynamic_budget: bool = True       # the pre-monitor sets m (False: m = k // 2)
    entropy_branching: bool = True    # branch after tool calls (False: k independent samples)
    max_tool_calls: int = 6
    max_response_tokens: int = 4096   # policy tokens and tool results together
    tool_limit_ends: bool = False     # past max_tool_calls: EOS and the end, as the official code (D10)
    trajectory_deadline_s: float = 0.0  # wall-clock seconds a trajectory may take (0 = none), checked per round
    lockstep_rollout: bool = False    # every tree waits for every other at each round (the synchronous rollout,
    #                                   algorithm.md §2e); False: each tree starts its next round when its own is done


@dataclass
class Trajectory:
    """One rollout, with its place in the tree. response_ids[i] was sampled by the policy iff
    loss_mask[i] == 1; tool results have mask 0."""
    group_id: int                     # question index in the batch
    traj_id: int                      # index within the group, 0..k-1 (creation order)
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    parent: int | None = None         # traj_id it was branched from; None for a global sample
    fork_offset: int = 0              # len(response_ids) of the parent at the fork
    round: int = 0                    # round in which it was created
    l: int = 0                        # consecutive branch-creating tool steps on its path
    kind: str = "global"              # "premonitor" | "global" | "branch" | "completion"
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # what each call returned (before format_result)
    gen_logp: list[float] | None = field(default_factory=list)  # the generator's log-prob of each response token
    #                                      (Segment.logprobs; 0.0 at tool tokens, nan at a token it did not sample),
    #                                      None once a segment came without them
    seg_entropies: list[float] = field(default_factory=list)
    branch_l: list[int] = field(default_factory=list)   # l at each branch this trajectory created
    result_ends: list[int] = field(default_factory=list)  # len(response_ids) after each tool result
    finish_reason: str = ""           # "answer" | "eos" | "length" | "deadline" ("" while active)
    truncated: bool = False           # ran out of the response-token budget
    text: str = ""                    # decoded response (policy tokens and tool results)
    started: float = field(default_factory=time.monotonic)   # when it was created (trajectory_deadline_s)

    @property
    def finished(self) -> bool:
        return self.finish_reason != ""


@dataclass
class Tree:
    """One question's trajectories, its global budget m (None until its pre-monitor has finished), the random draws of
    its branching decisions (its own: a tree does not depend on the others), and its rounds so far."""
    group_id: int
    prompt_ids: list[int]
    trajectories: list[Trajectory] = field(default_factory=list)
    m: int | None = None
    rng: Any = None                   # random.Random of its branching draws u
    rounds: int = 0

    def spawn(self, kind: str, rnd: int, n: int = 1) -> None:
        for _ in range(n):
            self.trajectories.append(Trajectory(self.group_id, len(self.trajectories), list(self.prompt_ids),
                                                round=rnd, kind=kind))


def tree_rollout(prompts: list[list[int]], generator: Generator, tool_runner, tokenizer,
                 settings: TreeSettings | None = None, *, sampling: Sampling = Sampling(), seed: int = 0,
                 progress=None, **overrides) -> tuple[list[Trajectory], dict]:
    """Roll out exactly k trajectories per prompt (algorithm.md §2). Returns them ordered by (group, traj_id) and the
    rollout's sums and counts (`tree_stats`).

    prompts: token ids per question (chat template applied); tool_runner: `.run(calls) -> (observations, counts)`
    like `tools.Tools`, called from worker threads; settings: `TreeSettings`, any of whose fields may also be given as
    a keyword (k=8); progress: None, or `progress(rounds_done, finished, total)` after every round of a tree, whose
    `on_step` method (if any) the generator calls after every decoding step."""
    s = dataclasses.replace(settings or TreeSettings(), **overrides)
    if s.k < 1:
        raise ValueError(f"k must be >= 1, got {s.k}")
    trees = []
    for g, prompt in enumerate(prompts):         # round 0 of each question, with its own draws u
        trees.append(_start(Tree(g, list(prompt), rng=random.Random(request_seed(seed, g))), s))

    def decide(t: Trajectory, step: int, tree: Tree) -> None:      # after tool result `step`, at its round's end
        if _branch_point(t, step, tree, s):
            _maybe_branch(t, step, tree, tree.rng, tree.rounds, s)
    rounds = Rounds(trees, generator, tool_runner, tokenizer, s, sampling, seed, progress, decide=decide,
                    settle=lambda tree: _settle(tree, tree.rng, tree.rounds, s))
    counts = rounds.run()
    trajectories = [t for tree in trees for t in tree.trajectories]
    for t in trajectories:
        t.text = rounds.fmt.response_text(tokenizer, t.response_ids, t.loss_mask, t.observations)
    return trajectories, tree_stats(trajectories, [tree.m for tree in trees], counts,
                                    max((tree.rounds for tree in trees), default=0))


def _start(tree: Tree, s: TreeSettings) -> Tree:
    """Round 0 of one question: k independent samples (no branching), a pre-monitor (dynamic budget), or m = k // 2
    global samples."""
    if not s.entropy_branching:
        tree.m = s.k
    elif not s.dynamic_budget:
        tree.m = max(1, s.k // 2)
    tree.spawn("premonitor" if tree.m is None else "global", 0, tree.m or 1)
    return tree


def _settle(tree: Tree, rng: random.Random, rnd: int, s: TreeSettings) -> None:
    """After a round: a finished pre-monitor sets m (§2a), starts the other m − 1 global samples and takes its
    deferred branching decisions (§2d); a question with no active trajectory and fewer than k gets fresh samples
    (§2c)."""
    first = tree.trajectories[0]
    if tree.m is None and first.finished:
        tree.m = premonitor_budget(first, s.k, s.beta)
        tree.spawn("global", rnd, tree.m - 1)
        for step in range(len(first.result_ends)):
            if _branch_point(first, step, tree, s):
                _maybe_branch(first, step, tree, rng, rnd, s)
    if tree.m is not None and len(tree.trajectories) < s.k and all(t.finished for t in tree.trajectories):
        tree.spawn("completion", rnd, s.k - len(tree.trajectories))


def _branch_point(t: Trajectory, step: int, tree: Tree, s: TreeSettings) -> bool:
    """Whether a branching decision (§2b) follows tool result `step` of t, in a round's end and in the pre-monitor's
    deferred decisions alike: branching is on, the tree's m is known, it has fewer than k trajectories, and the result
    is a tool's answer, not the tool-limit notice (D10) nor an `Error:` observation (D11), after which the authors'
    code takes no decision either (such a step leaves l as it was)."""
    if not (s.entropy_branching and tree.m is not None and len(tree.trajectories) < s.k):
        return False
    past_the_limit = step >= s.max_tool_calls        # the call was the tool-limit notice
    return not past_the_limit and not t.observations[step].startswith("Error:")


def _maybe_branch(t: Trajectory, step: int, tree: Tree, rng: random.Random, rnd: int, s: TreeSettings) -> None:
    """One branching decision after tool result `step` of t (algorithm.md §2b). The branch copies t's context up to
    the end of that result; l follows the path (inherited by the branch, reset by a step without a branch)."""
    delta_h = t.seg_entropies[step] - t.seg_entropies[0]  # segment `step` ended with this tool call
    p = min(1.0, max(0.0, branch_probability(rng.random(), delta_h, t.l, s.gamma, s.lam)))   # clipped, as officially
    if p < s.tau:
        t.l = 0
        return
    t.branch_l.append(t.l)
    t.l += 1
    fork = t.result_ends[step]
    tree.trajectories.append(Trajectory(
        t.group_id, len(tree.trajectories), list(t.prompt_ids), t.response_ids[:fork], t.loss_mask[:fork],
        gen_logp=None if t.gen_logp is None else t.gen_logp[:fork],
        parent=t.traj_id, fork_offset=fork, round=rnd, l=t.l, kind="branch", tool_calls=t.tool_calls[:step + 1],
        observations=t.observations[:step + 1], seg_entropies=t.seg_entropies[:step + 1],
        result_ends=t.result_ends[:step + 1]))


def tree_stats(trajectories: list[Trajectory], m_per_question: list, counts: dict, rounds: int) -> dict:
    """Sums and counts over a rollout's trees (means are formed when logged; docs/reference.md): questions,
    trajectories, Σ m, branches, trees with a branch and the sum of their top-chain shares (a tree's branches on its
    busiest root), tool calls, gen_len, resp_len, seq_len, truncated, shared_prefix (context tokens a prefix cache
    reuses), tool-limit and deadline hits, rounds (the most any tree took), gen_idle_s, the histogram of l at each
    branch, m per question, and the tool runner's counts (counts' tools/<tool>/<count> keys)."""
    by_group: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_group.setdefault(t.group_id, []).append(t)
    stats = Counter({"questions": len(m_per_question), "trajectories": len(trajectories), "m": sum(m_per_question),
                     "rounds": rounds, "tool_limit_hits": counts.get("tool_limit_hits", 0),
                     "deadline_hits": counts.get("deadline_hits", 0), "gen_idle_s": counts.get("gen_idle_s", 0.0)})
    l_hist: Counter = Counter(l for t in trajectories for l in t.branch_l)
    for group in by_group.values():
        root_of, per_root = {}, Counter()
        for t in group:
            root_of[t.traj_id] = t.traj_id if t.parent is None else root_of[t.parent]
            if t.parent is not None:
                per_root[root_of[t.traj_id]] += 1
        if per_root:
            stats["trees_branched"] += 1
            stats["branch_top_chain"] += max(per_root.values()) / sum(per_root.values())
        for t in group:
            stats["branches"] += t.parent is not None
            stats["tool_calls"] += len(t.tool_calls)
            stats["gen_len"] += sum(t.loss_mask)
            stats["resp_len"] += len(t.response_ids)
            stats["seq_len"] += len(t.prompt_ids) + len(t.response_ids)
            stats["truncated"] += t.truncated
            if t.parent is not None:                 # a branch starts from its parent's context at the fork
                stats["shared_prefix"] += len(t.prompt_ids) + t.fork_offset
            elif t.traj_id > 0:                      # another sample of the question shares its prompt
                stats["shared_prefix"] += len(t.prompt_ids)
    out = {key: stats[key] for key in ("questions", "trajectories", "m", "branches", "trees_branched",
                                       "branch_top_chain", "tool_calls", "gen_len", "resp_len", "seq_len", "truncated",
                                       "shared_prefix", "tool_limit_hits", "deadline_hits", "rounds", "gen_idle_s")}
    out.update(branch_l_hist=dict(sorted(l_hist.items())), m_per_question=list(m_per_question))
    out.update({key: v for key, v in counts.items() if key.startswith("tools/")})
    return out

