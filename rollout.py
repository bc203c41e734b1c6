"""Dynamic entropy-balanced tree rollout: the pre-monitor sets the global budget m, branching after tool calls
spends the rest, with a penalty on consecutive branches.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3.2; algorithm.md §1
(segment entropy) and §2 (the rollout). Each question gets a budget of k trajectories. One pre-monitor trajectory
measures how uncertain the policy is at the start (H_root) and after tool results (H_tool); that sets how many of
the k are independent global samples (m) and how many come from branching the tree after tool calls whose segment
entropy rose, with a penalty that stops one chain from taking every branch. The generator and the tools are passed
in (`Generator`, `tools.Tools`), so the rollout runs with a scripted model and fake tools (tests/fakes.py); this
file and tools.py copy alone.

Deviations from the paper / official code (algorithm.md §8): D1 (one pre-monitor, kept as a global sample), D2
(H_tool over its post-tool segments), D3 (m rounded up; no pre-monitor without the dynamic budget), D4 (the
consecutive-branch count per path, fresh every step), D5 (a branch's ΔH reference is its path's first segment), D6
(the pre-monitor's branching decisions taken when it finishes), D7 (groups completed with fresh samples), D10 (a
notice at the tool-call limit; `tool_limit_ends` does what the official code does).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol

import tools

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


# --------------------------------------------------------------------------------------------------
# The generation interface (generation.py implements it for transformers and vLLM): token ids in, segments out


@dataclass
class Segment:
    """What the policy generated between two environment events."""
    token_ids: list[int]
    finish_reason: str  # "tool" (closing tool tag), "answer" (</answer>), "eos", "length"
    h_seg: float        # segment_entropy of its first 20 positions
    text: str           # decoded, for parsing the tool call only (never re-encoded)


class Generator(Protocol):
    vocab_size: int

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], seed: int) -> list[Segment]:
        """One segment per context, sampled with the backend's temperature and top-p."""


# --------------------------------------------------------------------------------------------------
# The tree (algorithm.md §2)


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
    seg_entropies: list[float] = field(default_factory=list)
    branch_l: list[int] = field(default_factory=list)   # l at each branch this trajectory created
    result_ends: list[int] = field(default_factory=list)  # len(response_ids) after each tool result
    finish_reason: str = ""           # "answer" | "eos" | "length" ("" while active)
    truncated: bool = False           # ran out of the response-token budget
    text: str = ""                    # decoded response (policy tokens and tool results)

    @property
    def finished(self) -> bool:
        return self.finish_reason != ""


def tree_rollout(prompts: list[list[int]], generator: Generator, tool_runner, tokenizer, *,
                 k: int = 16, beta: float = 0.5, gamma: float = 0.2, lam: float = 0.05, tau: float = 0.5,
                 dynamic_budget: bool = True, entropy_branching: bool = True, max_tool_calls: int = 6,
                 max_response_tokens: int = 4096, seed: int = 0, progress=None, tool_limit_ends: bool = False
                 ) -> tuple[list[Trajectory], dict]:
    """Roll out exactly k trajectories per prompt (algorithm.md §2). Returns them ordered by (group, traj_id)
    and a dict of tree statistics.

    prompts: token ids per question (chat template applied). tool_runner: `tools.Tools`-like, with
    `.run(calls) -> (observations, counts)`. `entropy_branching=False` -> k independent samples.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    rng = random.Random(seed)
    groups: list[list[Trajectory]] = [[] for _ in prompts]
    m_of: list[int | None] = [None] * len(prompts)
    tool_counts: dict[str, int] = {}
    n_limit = 0

    def spawn(g: int, kind: str, rnd: int, n: int = 1) -> None:
        for _ in range(n):
            groups[g].append(Trajectory(g, len(groups[g]), list(prompts[g]), round=rnd, kind=kind))

    for g in range(len(prompts)):                    # round 0 starts
        if not entropy_branching:
            m_of[g] = k
            spawn(g, "global", 0, k)
        elif dynamic_budget:
            spawn(g, "premonitor", 0)                # m is set when it finishes
        else:
            m_of[g] = k // 2 if k > 1 else 1
            spawn(g, "global", 0, m_of[g])

    rnd = 0
    while True:
        active = [t for grp in groups for t in grp if not t.finished]
        if not active:
            break
        budgets = [max_response_tokens - len(t.response_ids) for t in active]
        segments = generator.generate([t.prompt_ids + t.response_ids for t in active], budgets,
                                      seed=seed * 7919 + rnd)
        calls, callers = [], []
        for t, seg in zip(active, segments):
            t.response_ids += seg.token_ids
            t.loss_mask += [1] * len(seg.token_ids)
            t.seg_entropies.append(seg.h_seg)
            if seg.finish_reason == "tool":
                if len(t.tool_calls) >= max_tool_calls:
                    n_limit += 1
                    if tool_limit_ends:                  # as the official code: EOS as a policy token, the end
                        if len(t.response_ids) < max_response_tokens:
                            t.response_ids.append(tokenizer.eos_token_id)
                            t.loss_mask.append(1)
                        t.finish_reason = "eos"
                        continue
                    call = tools.ToolError(f"tool-call limit ({max_tool_calls}) reached; "
                                           "give your final answer now")
                else:
                    call = tools.parse_tool_call(seg.text)
                t.tool_calls.append((call.tool, call.argument) if isinstance(call, tools.ToolCall)
                                    else ("error", call.message))
                calls.append(call)
                callers.append(t)
            else:
                t.finish_reason = seg.finish_reason
                t.truncated = seg.finish_reason == "length"
            if not t.finished and len(t.response_ids) >= max_response_tokens:
                t.finish_reason, t.truncated = "length", True

        observations, counts = tool_runner.run(calls) if calls else ([], {})
        for key, v in counts.items():
            tool_counts[key] = tool_counts.get(key, 0) + v
        for t, obs in zip(callers, observations):
            if t.finished:                           # budget already spent by the call itself
                continue
            result_ids = tokenizer.encode(tools.format_result(obs), add_special_tokens=False)
            room = max_response_tokens - len(t.response_ids)
            t.response_ids += result_ids[:room]
            t.loss_mask += [0] * len(result_ids[:room])
            if len(result_ids) >= room:
                t.finish_reason, t.truncated = "length", True
                continue
            t.result_ends.append(len(t.response_ids))
            if entropy_branching and m_of[t.group_id] is not None and len(groups[t.group_id]) < k:
                _maybe_branch(t, len(t.result_ends) - 1, groups[t.group_id], rng, rnd, gamma, lam, tau)

        rnd += 1
        for g, grp in enumerate(groups):             # pre-monitor done -> m; idle group -> complete
            if m_of[g] is None and grp[0].finished:
                h_root = grp[0].seg_entropies[0]
                after_tool = grp[0].seg_entropies[1:]
                h_tool = sum(after_tool) / len(after_tool) if after_tool else h_root
                m_of[g] = global_budget(k, h_root, h_tool, beta)
                spawn(g, "global", rnd, m_of[g] - 1)
                for step in range(len(grp[0].result_ends)):   # its deferred branching decisions
                    if len(grp) < k:
                        _maybe_branch(grp[0], step, grp, rng, rnd, gamma, lam, tau)
            if m_of[g] is not None and len(grp) < k and all(t.finished for t in grp):
                spawn(g, "completion", rnd, k - len(grp))
        if progress is not None:
            progress(rnd, sum(t.finished for grp in groups for t in grp), k * len(prompts))

    for grp in groups:
        for t in grp:
            t.text = tokenizer.decode(t.response_ids)
    trajectories = [t for grp in groups for t in grp]
    return trajectories, tree_stats(groups, m_of, tool_counts, n_limit, rnd)


def _maybe_branch(t: Trajectory, step: int, group: list[Trajectory], rng: random.Random, rnd: int,
                  gamma: float, lam: float, tau: float) -> None:
    """One branching decision after tool result `step` of t (algorithm.md §2b). The branch copies t's context
    up to the end of that result; l follows the path (inherited by the branch, reset by a step
    without a branch)."""
    delta_h = t.seg_entropies[step] - t.seg_entropies[0]  # segment `step` ended with this tool call
    p = min(1.0, max(0.0, branch_probability(rng.random(), delta_h, t.l, gamma, lam)))   # clipped, as officially
    if p < tau:
        t.l = 0
        return
    t.branch_l.append(t.l)
    t.l += 1
    fork = t.result_ends[step]
    group.append(Trajectory(
        t.group_id, len(group), list(t.prompt_ids), t.response_ids[:fork], t.loss_mask[:fork],
        parent=t.traj_id, fork_offset=fork, round=rnd, l=t.l, kind="branch",
        tool_calls=t.tool_calls[:step + 1], seg_entropies=t.seg_entropies[:step + 1],
        result_ends=t.result_ends[:step + 1]))


def tree_stats(groups: list[list[Trajectory]], m_of: list, tool_counts: dict, n_limit: int,
               rounds: int) -> dict:
    """Branching and budget statistics of one rollout (all means are per trajectory or per tree)."""
    trajs = [t for grp in groups for t in grp]
    n = max(1, len(trajs))
    branches = [sum(t.parent is not None for t in grp) for grp in groups]
    l_hist: dict[int, int] = {}
    for t in trajs:
        for l in t.branch_l:
            l_hist[l] = l_hist.get(l, 0) + 1
    top_chain, shared, total_ctx = [], 0, 0
    for grp in groups:
        root_of = {}
        for t in grp:
            root_of[t.traj_id] = t.traj_id if t.parent is None else root_of[t.parent]
        per_root: dict[int, int] = {}
        for t in grp:
            if t.parent is not None:
                per_root[root_of[t.traj_id]] = per_root.get(root_of[t.traj_id], 0) + 1
        if per_root:
            top_chain.append(max(per_root.values()) / sum(per_root.values()))
        for t in grp:                                # context a prefix cache would reuse at start
            total_ctx += len(t.prompt_ids) + len(t.response_ids)
            if t.parent is not None:
                shared += len(t.prompt_ids) + t.fork_offset
            elif t.traj_id > 0:
                shared += len(t.prompt_ids)
    stats = {
        "m": sum(m_of) / max(1, len(m_of)),
        "m_per_question": list(m_of),
        "branches_per_tree": sum(branches) / max(1, len(groups)),
        "branch_l_hist": dict(sorted(l_hist.items())),
        "branch_top_chain_share": sum(top_chain) / len(top_chain) if top_chain else 0.0,
        "trees_with_branches": len(top_chain),
        "tool_calls_per_traj": sum(len(t.tool_calls) for t in trajs) / n,
        "generated_tokens_per_traj": sum(sum(t.loss_mask) for t in trajs) / n,
        "response_tokens_per_traj": sum(len(t.response_ids) for t in trajs) / n,
        "truncated_frac": sum(t.truncated for t in trajs) / n,
        "tool_limit_hits": n_limit,
        "shared_prefix_frac": shared / max(1, total_ctx),
        "rounds": rounds,
    }
    stats.update({f"tools/{key}": v for key, v in tool_counts.items()})
    return stats
