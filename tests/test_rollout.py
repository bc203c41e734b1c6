"""Tree rollout (algorithm.md §1-§2): the formulas, and the tree driven by a scripted generator whose tool
calls and segment entropies the test controls."""
import math
import random
import re
from types import SimpleNamespace

import pytest

import rollout
import tools
from rollout import branch_probability, global_budget, segment_entropy, tree_rollout
from tests.fakes import TOK, Delayed, EchoTools, ScriptedGenerator, prompts


def run(n_q=2, k=8, seed=0, gen=None, **kw):
    gen = gen or ScriptedGenerator(n_tools=2, entropy=lambda s: 1.0 + 0.5 * s)
    return tree_rollout(prompts(n_q), gen, EchoTools(), TOK, k=k, seed=seed, **kw)


# ---------------------------------------------------------------------------------------------- formulas

def test_segment_entropy_by_hand():
    lps = [[math.log(0.5), math.log(0.25)], [math.log(1.0)]]
    expected = (0.5 * math.log(2) + 0.25 * math.log(4) + 0.0) / math.log(100)
    assert segment_entropy(lps, 100) == pytest.approx(expected)


def test_segment_entropy_uses_first_n_positions_only_and_is_a_sum():
    pos = [math.log(0.1)] * 10                    # uniform over the top 10: Σ = log 10 per position
    assert segment_entropy([pos] * 30, 1000, n=20) == pytest.approx(20 * math.log(10) / math.log(1000))
    assert segment_entropy([pos] * 5, 1000, n=20) == pytest.approx(5 * math.log(10) / math.log(1000))
    assert segment_entropy([], 1000) == 0.0


def test_global_budget_formula():
    """m = clip(ceil(k·σ(β(H_root − H_tool))), 1, k), β = 0.5, against values worked out by hand (k·σ in comments)."""
    table = {  # (h_root, h_tool): σ(0.5·ΔH) -> m for k = 4, 12, 16
        (1.0, 1.0): [2, 6, 8],          # σ = 0.5: k·σ = 2, 6, 8 exactly (equal entropies: k/2)
        (3.0, 0.5): [4, 10, 13],        # σ(1.25) = 0.7773: 3.11, 9.33, 12.44
        (0.2, 4.0): [1, 2, 3],          # σ(-1.9) = 0.1301: 0.52, 1.56, 2.08
        (10.0, 0.0): [4, 12, 16],       # σ(5) = 0.9933: 3.97, 11.92, 15.89
        (0.0, 40.0): [1, 1, 1],         # σ(-20) = 2e-9: clipped up to 1
    }
    for (h_root, h_tool), ms in table.items():
        assert [global_budget(k, h_root, h_tool) for k in (4, 12, 16)] == ms, (h_root, h_tool)
    assert global_budget(16, 0.0, 1e6) == 1 and global_budget(16, 1e6, 0.0) == 16


def test_branch_probability_formula():
    assert branch_probability(0.3, 1.0, 0) == pytest.approx(0.5)
    assert branch_probability(0.3, 1.0, 4) == pytest.approx(0.5 * 0.8)
    assert branch_probability(0.9, 5.0, 20) == 0.0               # λ·l ≥ 1 blocks branching
    assert branch_probability(0.5, 1.0, 2, gamma=0.5, lam=0.1) == pytest.approx(1.0 * 0.8)


@pytest.mark.parametrize("delta_h,l", [(0.0, 0), (1.0, 0), (-1.0, 0), (0.5, 4), (2.0, 8)])
def test_empirical_branch_rate_matches_probability(delta_h, l):
    """Over many draws of u, the branching frequency equals P(P_t ≥ τ) computed in closed form."""
    gamma, lam, tau, n = 0.2, 0.05, 0.5, 20000
    branched = 0
    for seed in range(n):
        t = rollout.Trajectory(0, 0, [1], [7, 8], [1, 0], seg_entropies=[1.0, 1.0 + delta_h], l=l,
                               result_ends=[1, 2])
        tree = rollout.Tree(0, [1], [t])
        rollout._maybe_branch(t, 1, tree, random.Random(seed), 1, rollout.TreeSettings(gamma=gamma, lam=lam, tau=tau))
        branched += len(tree.trajectories) == 2
    threshold = tau / (1 - min(1, lam * l)) - gamma * delta_h   # branch iff u ≥ threshold
    expected = 1 - min(1.0, max(0.0, threshold))
    sd = math.sqrt(expected * (1 - expected) / n) + 1e-9
    assert abs(branched / n - expected) < 5 * sd + 1e-3


# ---------------------------------------------------------------------------------------------- the tree

@pytest.mark.parametrize("flags", [dict(), dict(dynamic_budget=False), dict(entropy_branching=False)])
@pytest.mark.parametrize("k", [1, 5, 8])
def test_exactly_k_per_question(flags, k):
    trajs, stats = run(n_q=3, k=k, **flags)
    for g in range(3):
        group = [t for t in trajs if t.group_id == g]
        assert len(group) == k
        assert [t.traj_id for t in group] == list(range(k))
        assert all(t.finished for t in group)


def test_m_follows_the_premonitor():
    entropies = {0: 3.0, 1: 0.5, 2: 1.5}              # h_root = 3, h_tool = mean(0.5, 1.5) = 1
    gen = ScriptedGenerator(n_tools=2, entropy=lambda s: entropies[s])
    trajs, stats = run(n_q=2, k=12, gen=gen)
    m = 9                                              # ceil(12·σ(0.5·(3 − 1))) = ceil(12·0.7311) = ceil(8.77)
    assert stats["m_per_question"] == [m, m]
    for g in range(2):
        group = [t for t in trajs if t.group_id == g]
        assert group[0].kind == "premonitor"
        assert sum(t.kind in ("premonitor", "global") for t in group) == m
        assert sum(t.kind == "branch" for t in group) + sum(t.kind == "completion" for t in group) == 12 - m


def test_h_tool_is_the_mean_of_the_post_tool_segments():
    """algorithm.md §2a: H_tool = mean segment entropy of the pre-monitor's segments after a tool result. H_root = 3 and
    post-tool segments (0, 4): the mean 2 gives m = ceil(12·σ(0.5)) = ceil(7.47) = 8; the last one alone would give
    ceil(12·σ(-0.5)) = ceil(4.53) = 5, the first alone ceil(12·σ(1.5)) = ceil(9.81) = 10."""
    entropies = {0: 3.0, 1: 0.0, 2: 4.0}
    _, stats = run(n_q=1, k=12, gen=ScriptedGenerator(n_tools=2, entropy=lambda s: entropies[s]))
    assert stats["m_per_question"] == [8]


def test_dynamic_budget_off_gives_half_the_budget_whatever_the_entropies():
    """algorithm.md §2a switch: dynamic_budget=False -> m = k // 2 global samples started together, no pre-monitor. The
    entropies (H_root = 0, H_tool = 20) would give the dynamic m = ceil(12·σ(-10)) = ceil(0.0005) = 1."""
    gen = ScriptedGenerator(n_tools=2, entropy=lambda s: 0.0 if s == 0 else 20.0)
    trajs, stats = run(n_q=2, k=12, gen=gen, dynamic_budget=False)
    assert stats["m_per_question"] == [6, 6]
    for g in range(2):
        group = [t for t in trajs if t.group_id == g]
        assert [t.kind for t in group[:6]] == ["global"] * 6 and all(t.round == 0 for t in group[:6])
        assert all(t.kind != "global" for t in group[6:]) and len(group) == 12
    _, stats = run(n_q=2, k=12, gen=gen)                              # the same entropies, dynamic
    assert stats["m_per_question"] == [1, 1]


def test_no_tool_call_premonitor_uses_h_root_and_static_budget():
    gen = ScriptedGenerator(n_tools=0, entropy=lambda s: 2.0)
    _, stats = run(n_q=1, k=6, gen=gen)
    assert stats["m_per_question"] == [3]                             # H_tool = H_root: ceil(6·σ(0)) = 3
    _, stats = run(n_q=1, k=6, gen=gen, dynamic_budget=False)
    assert stats["m_per_question"] == [3]


def test_entropy_branching_off_gives_k_independent_samples():
    trajs, stats = run(n_q=2, k=6, entropy_branching=False, gamma=100.0)  # γ would force branches
    assert all(t.parent is None and t.kind == "global" and t.round == 0 for t in trajs)
    assert stats["branches"] == 0


def test_branches_spend_the_budget_and_record_the_tree():
    gen = ScriptedGenerator(n_tools=3, entropy=lambda s: 1.0 + 2.0 * s)   # entropy rises after tools
    trajs, stats = run(n_q=2, k=8, gen=gen, gamma=1.0)
    branches = [t for t in trajs if t.parent is not None]
    assert branches and stats["branches"] == len(branches) and stats["questions"] == 2
    for b in branches:
        parent = next(t for t in trajs if t.group_id == b.group_id and t.traj_id == b.parent)
        assert b.kind == "branch" and b.traj_id > parent.traj_id
        # the branch shares the parent's context up to the fork, which ends with a tool result
        assert b.response_ids[:b.fork_offset] == parent.response_ids[:b.fork_offset]
        assert TOK.decode(b.response_ids[:b.fork_offset]).endswith("</result>\n")
        assert b.seg_entropies[0] == parent.seg_entropies[0]


def test_penalty_follows_the_path_not_the_question():
    """λ = 1: a path that just branched (l = 1) may not branch at its next tool step, while other
    paths of the same question (l = 0) still may; with a per-question count they could not."""
    gen = ScriptedGenerator(n_tools=4, entropy=lambda s: 10.0 * s)     # ΔH ≫ 0 after the first tool
    trajs, _ = run(n_q=1, k=16, gen=gen, gamma=1.0, lam=1.0, dynamic_budget=False)
    created = [l for t in trajs for l in t.branch_l]
    assert created and all(l == 0 for l in created)                    # only l = 0 paths branched
    parents = {t.parent for t in trajs if t.parent is not None}
    assert len(parents) >= 2                                           # several paths branched
    # a path's count is inherited by its branch and reset by a step without a branch
    for t in trajs:
        if t.parent is not None:
            assert t.l in (0, 1)


class ConstantU:
    """A random.Random stand-in whose every draw u is the same number."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def constant_u_tree(monkeypatch):
    """One question, k = 4, every u = 0.6, γ = 0, λ = 0.3, τ = 0.5: P_t = 0.6·(1 − 0.3·l) branches iff l = 0
    (l = 1 gives 0.42). Entropies 0 then 20 give m = 1, so the budget goes to branches; every path makes 4 searches."""
    monkeypatch.setattr(rollout, "random", SimpleNamespace(Random=lambda seed: ConstantU(0.6)))
    gen = ScriptedGenerator(n_tools=4, entropy=lambda s: 0.0 if s == 0 else 20.0)
    return tree_rollout(prompts(1), gen, EchoTools(), TOK, k=4, gamma=0.0, lam=0.3, tau=0.5)


def results_before_fork(t):
    return TOK.decode(t.response_ids[:t.fork_offset]).count("<result>")


def test_consecutive_branch_count_resets_and_is_inherited(monkeypatch):
    """algorithm.md §2b: l counts the consecutive branch-creating tool steps on the path: a step without a branch resets it
    to 0, a branch starts with its parent's count. Worked by hand (tool steps 0..3 of each path):
    - pre-monitor (its decisions taken when it finishes, m = 1): step 0 l=0 branch (B1, l=1); step 1 l=1 no (reset);
      step 2 l=0 branch (B2, l=1); step 3 l=1 no.
    - B1 (from step 0): step 1 l=1 no (reset); step 2 l=0 branch (B3); the group is then full (k = 4).
    - B2 (from step 2): step 3 l=1 no (reset to 0). B3 (from B1's step 2) meets a full group.
    Without the reset the pre-monitor and B1 branch once each (then l sticks at 1); with l = 0 for a new branch B1
    branches at its step 1."""
    trajs, stats = constant_u_tree(monkeypatch)
    tree = [(t.traj_id, t.kind, t.parent, results_before_fork(t), t.branch_l, t.l) for t in trajs]
    assert tree == [(0, "premonitor", None, 0, [0, 0], 0),
                    (1, "branch", 0, 1, [0], 1),
                    (2, "branch", 0, 3, [], 0),
                    (3, "branch", 1, 3, [], 1)]
    assert stats["m_per_question"] == [1] and stats["branch_l_hist"] == {0: 3}


def test_tree_stats_by_hand(monkeypatch):
    """tree_stats on the hand-worked tree above: 3 branches, all on the pre-monitor's tree (top-chain share 1); every
    path made 4 searches, of which 4 + 3 + 1 + 1 = 9 ran (the rest were inherited); 9 rounds (the pre-monitor's 5,
    B1's 4 more). Token counts are checked against the decoded text, not the loss mask."""
    trajs, stats = constant_u_tree(monkeypatch)
    assert {key: stats[key] for key in ("questions", "trajectories", "m", "branches", "branch_top_chain",
                                        "trees_branched", "tool_calls", "tools/search/calls", "tool_limit_hits",
                                        "truncated", "rounds")} == \
        {"questions": 1, "trajectories": 4, "m": 1, "branches": 3, "branch_top_chain": 1.0, "trees_branched": 1,
         "tool_calls": 16, "tools/search/calls": 9, "tool_limit_hits": 0, "truncated": 0, "rounds": 9}
    texts = [TOK.decode(t.response_ids) for t in trajs]
    assert all(text.count("<search>") == 4 for text in texts)
    results = [sum(len(m) for m in re.findall(r"\n<result>\n.*?\n</result>\n", text, re.DOTALL)) for text in texts]
    assert stats["gen_len"] == sum(len(x) - r for x, r in zip(texts, results))
    assert stats["resp_len"] == sum(len(x) for x in texts)
    prompt = len(prompts(1)[0])
    ends = [m.end() for m in re.finditer("</result>\n", texts[0])]       # the pre-monitor's result ends
    b1_ends = [m.end() for m in re.finditer("</result>\n", texts[1])]
    shared = (prompt + ends[0]) + (prompt + ends[2]) + (prompt + b1_ends[2])   # B1, B2, B3 share up to their fork
    assert stats["shared_prefix"] == shared and stats["seq_len"] == sum(prompt + len(x) for x in texts)


def test_penalty_lowers_branch_concentration():
    gen = ScriptedGenerator(n_tools=5, entropy=lambda s: 2.0 * s)
    # h_root = 0 ≪ h_tool: m = 1, so the whole budget goes to branching
    no_penalty = [run(n_q=4, k=12, gen=gen, lam=0.0, seed=s)[1] for s in range(6)]
    penalty = [run(n_q=4, k=12, gen=gen, lam=0.5, seed=s)[1] for s in range(6)]
    assert all(st["m_per_question"] == [1] * 4 for st in no_penalty + penalty)
    hist_no = sum(sum(v for l, v in st["branch_l_hist"].items() if l >= 2) for st in no_penalty)
    hist_pen = sum(sum(v for l, v in st["branch_l_hist"].items() if l >= 2) for st in penalty)
    assert hist_pen < hist_no


class NumberedAnswers:
    """Answers at once (no tool call), each segment with a serial number no other segment has."""
    vocab_size = 1000

    def __init__(self):
        self.contexts = 0

    def generate(self, contexts, max_new_tokens, seed, sampling=None, on_step=None):
        out = []
        for _ in contexts:
            self.contexts += 1
            ids = TOK.encode(f"<think>done</think> <answer>\\boxed{{{self.contexts}}}</answer>")
            out.append(rollout.Segment(ids, "answer", 1.0, TOK.decode(ids)))
        return out


def test_completion_adds_fresh_samples_not_duplicates():
    """algorithm.md §2c: a group short of k after every trajectory finished gets fresh global samples, generated from the
    prompt, never copies of a finished trajectory (duplicates distort the group statistics)."""
    gen = NumberedAnswers()
    trajs, stats = tree_rollout(prompts(2), gen, EchoTools(), TOK, k=6)   # no tools -> no branching; m = 3
    assert stats["m_per_question"] == [3, 3]
    assert gen.contexts == 2 * 6                                       # every trajectory was generated
    for g in range(2):
        group = [t for t in trajs if t.group_id == g]
        completions = [t for t in group if t.kind == "completion"]
        assert len(completions) == 3
        assert all(t.parent is None and t.fork_offset == 0 and t.round > 0 for t in completions)
        assert len({TOK.decode(t.response_ids) for t in group}) == 6   # six different samples
        # completions were generated in their own rounds, after every earlier trajectory finished
        assert all(c.round >= max(t.round for t in group if t.kind != "completion") + 1 for c in completions)


def test_loss_mask_covers_exactly_the_sampled_tokens():
    trajs, _ = run(n_q=2, k=8, gamma=1.0)
    for t in trajs:
        assert len(t.loss_mask) == len(t.response_ids)
        text = TOK.decode(t.response_ids)
        in_result = [0] * len(text)
        for m in re.finditer(r"\n<result>\n.*?\n</result>\n", text, re.DOTALL):
            in_result[m.start():m.end()] = [1] * (m.end() - m.start())
        assert t.loss_mask == [1 - r for r in in_result]


def test_tool_results_are_appended_as_format_result():
    trajs, _ = run(n_q=1, k=3, entropy_branching=False)
    text = trajs[0].text
    assert "\n<result>\ndoc about q0" in text and text.count("<result>") == 2
    assert trajs[0].tool_calls[0][0] == "search"


def test_same_seed_same_tree_other_seed_other_tree():
    def shape(trajs):
        return [(t.group_id, t.traj_id, t.parent, t.fork_offset, t.round, t.kind, tuple(t.response_ids))
                for t in trajs]
    a, sa = run(n_q=3, k=8, seed=5, gamma=0.6)
    b, sb = run(n_q=3, k=8, seed=5, gamma=0.6)
    c, _ = run(n_q=3, k=8, seed=6, gamma=0.6)
    timed = ("gen_idle_s",)                                              # a measurement, not part of the tree
    assert shape(a) == shape(b) and {k: v for k, v in sa.items() if k not in timed} == \
        {k: v for k, v in sb.items() if k not in timed}
    assert shape(a) != shape(c)


def test_tool_call_limit_and_token_budget():
    """A policy that would call a tool 50 times: exactly max_tool_calls = 3 calls of each trajectory reach the tool
    runner, every later call gets the limit notice instead; a response budget ends every trajectory."""
    gen = ScriptedGenerator(n_tools=50, entropy=lambda s: 1.0)
    runner = EchoTools()
    trajs, stats = tree_rollout(prompts(1), gen, runner, TOK, k=2, seed=0, entropy_branching=False, max_tool_calls=3,
                                max_response_tokens=100_000)
    executed = [c for calls in runner.rounds for c in calls if isinstance(c, tools.ToolCall)]
    assert len(executed) == 2 * 3
    for t in trajs:
        assert [tool for tool, _ in t.tool_calls] == ["search"] * 3 + ["error"] * 47
        assert t.text.count("doc about") == 3 and t.text.count("tool-call limit (3) reached") == 47
    assert stats["tool_limit_hits"] == 2 * 47
    trajs, stats = run(n_q=1, k=2, gen=gen, entropy_branching=False, max_response_tokens=300)
    assert all(t.truncated and t.finish_reason == "length" and len(t.response_ids) <= 300 for t in trajs)
    assert stats["truncated"] == stats["trajectories"]


def test_stats_count_executed_tool_calls():
    trajs, stats = run(n_q=3, k=8, gamma=1.0)
    assert sum(stats["branch_l_hist"].values()) == sum(t.parent is not None for t in trajs)
    # a branch inherits its parent's calls up to the fork; only the calls after it were executed
    executed = sum(TOK.decode(t.response_ids[t.fork_offset:]).count("<search>") for t in trajs)
    assert stats["tools/search/calls"] == executed


class FixedSearch:
    """Every segment is the same search call; records the token budgets it is given."""
    vocab_size = 1000
    text = "<search> q </search>"

    def __init__(self):
        self.budgets = []

    def generate(self, contexts, max_new_tokens, seed, sampling=None, on_step=None):
        self.budgets.append(list(max_new_tokens))
        ids = TOK.encode(self.text)
        return [rollout.Segment(ids[:n], "tool" if n >= len(ids) else "length", 1.0, TOK.decode(ids[:n]))
                for n in max_new_tokens]


@pytest.mark.parametrize("spare", [0, 1])
def test_tool_result_that_fills_the_budget_ends_the_trajectory(spare):
    """A tool result that exactly fills the remaining response budget ends the trajectory (truncated, no branching
    point recorded): the generator is never asked for 0 tokens (vLLM rejects max_tokens=0). One token more and it
    goes on with a budget of 1."""
    result = TOK.encode(tools.format_result("doc about q"))
    gen = FixedSearch()
    budget = len(FixedSearch.text) + len(result) + spare
    trajs, _ = tree_rollout(prompts(1), gen, EchoTools(), TOK, k=1, max_response_tokens=budget)
    t = trajs[0]
    assert all(n > 0 for call in gen.budgets for n in call)
    assert t.truncated and t.finish_reason == "length" and len(t.response_ids) == budget
    if spare == 0:
        assert gen.budgets == [[budget]] and t.result_ends == []
        assert t.loss_mask == [1] * len(FixedSearch.text) + [0] * len(result)
    else:
        assert gen.budgets == [[budget], [1]] and t.result_ends == [budget - 1]


# ---------------------------------------------------------------------------------------------- rules a break would hide


class FixedU:
    """An rng whose every draw is u (rollout._maybe_branch draws u ~ U(0, 1) with .random())."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def decide(seg_entropies, step, u, **settings):
    """Whether one decision after tool result `step` branches, on a path with these segment entropies."""
    t = rollout.Trajectory(0, 0, [1], list(range(len(seg_entropies))), [1] * len(seg_entropies),
                           seg_entropies=list(seg_entropies), result_ends=list(range(1, len(seg_entropies) + 1)))
    tree = rollout.Tree(0, [1], [t])
    rollout._maybe_branch(t, step, tree, FixedU(u), 1, rollout.TreeSettings(**settings))
    return len(tree.trajectories) == 2


def test_delta_h_is_measured_against_the_paths_first_segment():
    """algorithm.md §2b, D5: ΔH = H_seg(latest) − H_seg(first segment of the path), not of the previous segment. At step
    2 of entropies (1, 5, 2) ΔH = 1 (P = 0.4 + 0.2 = 0.6 ≥ 0.5: a branch); against the previous segment it would be
    −3 (P = −0.2: none). At step 1 the two references coincide, so the rule needs a later step to show."""
    assert decide([1.0, 5.0, 2.0], 2, u=0.4, gamma=0.2, tau=0.5)
    assert not decide([1.0, 5.0, 2.0], 2, u=0.4, gamma=-0.2, tau=0.5)          # the sign of γΔH matters
    assert not decide([4.0, 5.0, 2.0], 2, u=0.4, gamma=0.2, tau=0.5)           # ΔH = −2 against a higher first
    # a branch's path starts at its parent's first segment: its inherited seg_entropies[0]
    parent = rollout.Trajectory(0, 0, [1], [5, 6, 7], [1, 0, 1], seg_entropies=[1.0, 5.0], result_ends=[2, 3])
    tree = rollout.Tree(0, [1], [parent])
    rollout._maybe_branch(parent, 1, tree, FixedU(0.9), 1, rollout.TreeSettings())
    branch = tree.trajectories[1]
    assert branch.seg_entropies == [1.0, 5.0] and branch.seg_entropies[0] == parent.seg_entropies[0]


def test_branch_probability_is_clipped_to_the_unit_interval_before_tau():
    """The official code clips P to [0, 1] before comparing it with τ: with τ ≤ 0 a negative P still branches (0 ≥ 0),
    with τ > 1 no P does (1 < τ); without the clip P = −0.6 would not branch at τ = 0 and P = 1.4 would at τ = 1.2."""
    assert decide([1.0, 1.0, -4.0], 2, u=0.4, gamma=0.2, tau=0.0)              # P = 0.4 − 1 = −0.6 -> 0 ≥ 0
    assert not decide([1.0, 1.0, 6.0], 2, u=0.4, gamma=0.2, tau=1.2)           # P = 0.4 + 1 = 1.4 -> 1 < 1.2
    assert decide([1.0, 1.0, 6.0], 2, u=0.4, gamma=0.2, tau=1.0)               # 1 ≥ 1


def test_tool_limit_ends_appends_eos_as_a_policy_token():
    """D10, --set tool_limit_ends: at the tool-call limit the official code appends EOS as a policy token and ends the
    trajectory; without it the trajectory reads a notice and goes on (here: to the token budget)."""
    gen = ScriptedGenerator(n_tools=50, entropy=lambda s: 1.0)
    trajs, stats = tree_rollout(prompts(1), gen, EchoTools(), TOK, k=2, seed=0, entropy_branching=False,
                                max_tool_calls=2, max_response_tokens=100_000, tool_limit_ends=True)
    for t in trajs:
        assert t.finish_reason == "eos" and not t.truncated
        assert t.response_ids[-1] == TOK.eos_token_id and t.loss_mask[-1] == 1   # EOS, trained as a policy token
        assert [tool for tool, _ in t.tool_calls] == ["search", "search"] and "tool-call limit" not in t.text
        assert TOK.decode(t.response_ids).endswith("</search>")                  # the third call, then EOS
    assert stats["tool_limit_hits"] == 2
    trajs, _ = tree_rollout(prompts(1), gen, EchoTools(), TOK, k=2, seed=0, entropy_branching=False,
                            max_tool_calls=2, max_response_tokens=2_000)
    assert all(t.finish_reason == "length" and "tool-call limit (2) reached" in t.text for t in trajs)


class SlowGenerator(ScriptedGenerator):
    """The scripted generator, taking `seconds` per segment (a slow tool or a long tail stands in for it)."""

    def __init__(self, seconds, **kw):
        super().__init__(**kw)
        self.seconds = seconds

    def segment(self, context, limit, seed):
        import time
        time.sleep(self.seconds)
        return super().segment(context, limit, seed)


def test_a_trajectory_past_its_deadline_ends_truncated():
    """--set trajectory_deadline_s: a trajectory older than the deadline after a round ends like one past its token
    budget (truncated, finish_reason "deadline"), counted in deadline_hits; without a deadline the same policy runs
    its 20 tool calls to the end."""
    gen = SlowGenerator(0.15, n_tools=20, entropy=lambda s: 1.0)
    trajs, stats = tree_rollout(prompts(1), gen, EchoTools(), TOK, k=2, seed=0, entropy_branching=False,
                                max_tool_calls=20, max_response_tokens=100_000, trajectory_deadline_s=1.0)
    assert all(t.finish_reason == "deadline" and t.truncated for t in trajs)
    assert stats["deadline_hits"] == 2 and 2 <= stats["rounds"] <= 5 and all(len(t.tool_calls) < 20 for t in trajs)
    trajs, stats = tree_rollout(prompts(1), ScriptedGenerator(n_tools=20), EchoTools(), TOK, k=2, seed=0,
                                entropy_branching=False, max_tool_calls=20, max_response_tokens=100_000)
    assert all(t.finish_reason == "answer" for t in trajs) and stats["deadline_hits"] == 0


# ---------------------------------------------------------------------------------------------- trees at their own pace
# (algorithm.md §2e: each tree keeps its round order; different trees are at different rounds at once)


def tree_record(trajs, stats):
    """Everything a tree is: tokens, masks, branch points, kinds, rounds, l, tool calls, entropies, and the budgets."""
    return ([(t.group_id, t.traj_id, t.parent, t.fork_offset, t.round, t.l, t.kind, t.branch_l, t.result_ends,
              t.finish_reason, t.truncated, tuple(t.response_ids), tuple(t.loss_mask), t.tool_calls, t.seg_entropies)
             for t in trajs], stats["m_per_question"], stats["branches"], stats["rounds"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trees_at_their_own_pace_equal_the_lockstep_trees(seed):
    """Under random tool latencies the asynchronous rollout (each tree starts its next round when its own calls are
    back) and the lockstep one (every tree waits for every other) give identical trees: each chain's segments are
    seeded by (seed, question, chain, segment) and each tree's branching draws by (seed, question), so nothing
    depends on which trees share a decoding step or on the order calls come back. The asynchronous run did interleave:
    in lockstep every decoding step holds every tree still running (the questions of a step include the next
    step's), while asynchronously a tree whose calls were slow sits out a step and comes back in a later one."""
    def rollout_with(lockstep):
        gen = ScriptedGenerator(n_tools=lambda rng: rng.randint(1, 4), entropy=lambda s: 1.0 + 0.7 * s)
        steps = []
        real_start = gen.start

        def start(sampling=None, on_step=None):                         # record each step's questions
            decoding = real_start(sampling, on_step)
            real_step = decoding.step

            def step():
                steps.append({TOK.decode(c).split("<|assistant|>")[0] for _, c, _, _ in decoding.queue})
                return real_step()
            decoding.step = step
            return decoding
        gen.start = start
        trajs, stats = tree_rollout(prompts(4), gen, Delayed(EchoTools(), seed), TOK, k=6, seed=seed, gamma=0.8,
                                    lockstep_rollout=lockstep)
        return tree_record(trajs, stats), steps
    together, lockstep_steps = rollout_with(True)
    alone, async_steps = rollout_with(False)
    assert alone == together
    assert all(now >= later for now, later in zip(lockstep_steps, lockstep_steps[1:]))
    assert any(not now >= later for now, later in zip(async_steps, async_steps[1:])), \
        "no tree ever sat out a decoding step and came back: the asynchronous rollout did not interleave"


class NamedQueries(ScriptedGenerator):
    """ScriptedGenerator whose queries name their question (`<search> question 3: q1 57 </search>`), logging each
    segment as ("segment", question, tool results before it) in `log`."""

    def __init__(self, log, **kw):
        super().__init__(**kw)
        self.events = log

    def segment(self, context, limit, seed):
        text = TOK.decode(context)
        question = text.split("<|user|>")[1].split("?")[0]
        self.events.append(("segment", question, text.count("<result>")))
        seg = super().segment(context, limit, seed)
        named = seg.text.replace("<search> q", f"<search> {question}: q")
        return rollout.Segment(TOK.encode(named), seg.finish_reason, seg.h_seg, named)


class GatedTools(EchoTools):
    """Question 0's first search waits until `others_done` is set (a slow search), at most `wait_s`; every other call
    returns at once. Logs the slow call's start and end beside the generator's segments."""
    format = tools.TAGS

    def __init__(self, log, others_done, wait_s):
        super().__init__()
        self.log, self.others_done, self.wait_s = log, others_done, wait_s

    def run(self, calls):
        if any(isinstance(c, tools.ToolCall) and c.argument.startswith("question 0: q0 ") for c in calls):
            self.log.append(("slow call", "sent"))
            finished = self.others_done.wait(self.wait_s)   # the deadline only ends a wait that would never end
            self.log.append(("slow call", "back" if finished else "back, the others never finished"))
        return super().run(calls)


def test_a_tree_waiting_on_a_slow_tool_does_not_hold_the_others():
    """One tree's first search takes up to 5 s (it returns as soon as the other trees are done); meanwhile the other
    trees go on generating, call their tools and finish (an order check on the log, not a timing: their later
    segments come between the slow call's start and end). In lockstep the others cannot pass their first round while
    it waits, so the same call runs its full 5 s and nobody generates in between."""
    import threading

    def run(lockstep):
        log, others_done = [], threading.Event()
        gen = NamedQueries(log, n_tools=2, entropy=lambda s: 1.0)

        def progress(rounds, finished, total):         # question 0's 2 trajectories wait: the other 6 are done
            if finished >= total - 2:
                others_done.set()
        trajs, _ = tree_rollout(prompts(4), gen, GatedTools(log, others_done, wait_s=5.0), TOK, k=2, seed=0,
                                entropy_branching=False, lockstep_rollout=lockstep, progress=progress)
        assert all(t.finished and t.finish_reason == "answer" for t in trajs)
        sent = log.index(("slow call", "sent"))
        back = next(i for i, event in enumerate(log) if event[0] == "slow call" and i > sent)
        return log[sent + 1:back], log[back][1]

    between, how = run(lockstep=False)
    assert how == "back"
    assert {(q, step) for _, q, step in between} == {(f"question {i}", s) for i in (1, 2, 3) for s in (1, 2)}
    between, how = run(lockstep=True)
    assert between == [] and how == "back, the others never finished"


class Flaky(tools.Tool):
    """A tool whose call `q0 …` raises, `q1 …` outlasts its 1 s timeout, and every other call answers (well within
    it, also on a loaded machine: 0.2 s was met by an answering call there)."""
    name, timeout_s = "flaky", 1.0
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}

    def run(self, calls):
        import time
        if calls[0]["x"].startswith("q0"):
            raise RuntimeError("the backend is down")
        if calls[0]["x"].startswith("q1"):
            time.sleep(3.0)
        return [f"ok {c['x']}" for c in calls]


def test_failed_and_timed_out_calls_read_the_same_in_both_schedules():
    """A call that raises and one that times out become the same `Error: ...` observations whether trees wait for
    each other or not (the tool runner's own rules, now run from worker threads), and every tree still ends."""
    texts = []
    for lockstep in (True, False):
        runner = tools.Tools(None, tools=[Flaky()])
        try:
            trajs, stats = tree_rollout(prompts(3), ScriptedGenerator(n_tools=3, tool="flaky"), runner, TOK, k=2,
                                        seed=4, entropy_branching=False, lockstep_rollout=lockstep)
        finally:
            runner.close()
        assert all(t.finished for t in trajs) and stats["tools/flaky/errors"] == stats["tools/flaky/calls"] - 6
        texts.append([t.observations for t in trajs])
    assert texts[0] == texts[1]
    first = texts[0][0]
    assert first[0] == "Error: flaky failed: RuntimeError: the backend is down"
    assert first[1] == "Error: flaky timed out after 1 s" and first[2].startswith("ok q2")


class FirstCallFails(EchoTools):
    """A trajectory's first call (`q0 …`) fails: an `Error:` observation. A malformed call, the tool-limit notice
    among them, reads `notice: …` here, so that only its place past max_tool_calls marks the notice."""

    def run(self, calls):
        observations = []
        for call in calls:
            if isinstance(call, tools.ToolError):
                observations.append(f"notice: {call.message}")
            elif call.argument.startswith("q0 "):
                observations.append("Error: search failed: the backend is down")
            else:
                observations.append(f"doc about {call.argument}")
        return observations, {"search/calls": len(calls)}


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "own pace"])
def test_no_branching_decision_after_an_error_or_the_tool_limit_notice(lockstep):
    """D10, D11: no branching decision follows an `Error:` observation or the tool-limit notice, at a round's end and
    in the pre-monitor's deferred decisions, in either schedule (the authors' code takes none there). Each chain
    calls 4 times with max_tool_calls = 2: call 0 fails, call 1 is answered, calls 2 and 3 get the notice; with γ = 5
    and ΔH = step every decision at steps 1-3 would branch, and a branch at step 0 or 2 or 3 would be seen. Only
    step 1 is a branch point: every branch forks after an answered call."""
    gen = ScriptedGenerator(n_tools=4, entropy=lambda step: 1.0 + step)
    trajs, stats = tree_rollout(prompts(2), gen, FirstCallFails(), TOK, k=8, seed=0, gamma=5.0, max_tool_calls=2,
                                lockstep_rollout=lockstep)
    by_id = {(t.group_id, t.traj_id): t for t in trajs}
    fork_steps = []
    for branch in [t for t in trajs if t.parent is not None]:
        parent = by_id[(branch.group_id, branch.parent)]
        fork_steps.append(parent.result_ends.index(branch.fork_offset))
    assert len(trajs) == 16 and stats["tool_limit_hits"] > 0
    assert fork_steps and set(fork_steps) == {1}, fork_steps


def test_the_watchdog_names_a_stuck_call_while_other_trees_run():
    """Tool calls run in worker threads: the watchdog watches each thread, so a call that hangs is named ("running
    search call 'question 0: q0 ...'") while the other trees generate (and the rollout is not blocked)."""
    import io
    import threading
    from harness.run import watchdog
    out, log, named = io.StringIO(), [], threading.Event()

    class Reporting(io.StringIO):
        def write(self, text):
            if "running search call 'question 0: q0" in text:
                named.set()
            return out.write(text)
    dog = watchdog.Watchdog(0, 0.3, out=Reporting())
    watchdog.set_current(dog)
    try:
        runner = watchdog.WatchedTools(GatedTools(log, named, wait_s=5.0))
        trajs, _ = tree_rollout(prompts(3), NamedQueries(log, n_tools=1), runner, TOK, k=1, seed=0,
                                entropy_branching=False)
    finally:
        dog.close()
        watchdog.set_current(watchdog.Watchdog(0, 0.0))
    assert ("slow call", "back") in log, "the watchdog never named the stuck call"          # the 5 s bound a hang
    assert "watchdog: rank 0 has been running search call 'question 0: q0" in out.getvalue()
    assert all(t.finished for t in trajs)
