"""Tree rollout (SPEC §1-§2): the formulas, and the tree driven by a scripted generator whose tool
calls and segment entropies the test controls."""
import math
import random
import re

import pytest

import rollout
from rollout import branch_probability, global_budget, segment_entropy, tree_rollout
from tests.fakes import CharTokenizer, EchoTools, ScriptedGenerator

TOK = CharTokenizer()


def prompts(n):
    return [TOK.encode(f"<|user|>question {i}?<|assistant|>") for i in range(n)]


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
    for k in (4, 12, 16):
        for h_root, h_tool in [(1.0, 1.0), (3.0, 0.5), (0.2, 4.0), (10.0, 0.0), (0.0, 40.0)]:
            sigma = 1 / (1 + math.exp(-0.5 * (h_root - h_tool)))
            assert global_budget(k, h_root, h_tool) == min(k, max(1, math.ceil(k * sigma - 1e-9)))
    assert global_budget(16, 1.0, 1.0) == 8                      # equal entropies: k/2 (ceil)
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
        group = [t]
        rollout._maybe_branch(t, 1, group, random.Random(seed), 1, gamma, lam, tau)
        branched += len(group) == 2
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
    m = global_budget(12, 3.0, 1.0)
    assert stats["m_per_question"] == [m, m]
    for g in range(2):
        group = [t for t in trajs if t.group_id == g]
        assert group[0].kind == "premonitor"
        assert sum(t.kind in ("premonitor", "global") for t in group) == m
        assert sum(t.kind == "branch" for t in group) + sum(t.kind == "completion" for t in group) == 12 - m


def test_no_tool_call_premonitor_uses_h_root_and_static_budget():
    gen = ScriptedGenerator(n_tools=0, entropy=lambda s: 2.0)
    _, stats = run(n_q=1, k=6, gen=gen)
    assert stats["m_per_question"] == [global_budget(6, 2.0, 2.0)] == [3]
    _, stats = run(n_q=1, k=6, gen=gen, dynamic_budget=False)
    assert stats["m_per_question"] == [3]


def test_entropy_branching_off_gives_k_independent_samples():
    trajs, stats = run(n_q=2, k=6, entropy_branching=False, gamma=100.0)  # γ would force branches
    assert all(t.parent is None and t.kind == "global" and t.round == 0 for t in trajs)
    assert stats["branches_per_tree"] == 0


def test_branches_spend_the_budget_and_record_the_tree():
    gen = ScriptedGenerator(n_tools=3, entropy=lambda s: 1.0 + 2.0 * s)   # entropy rises after tools
    trajs, stats = run(n_q=2, k=8, gen=gen, gamma=1.0)
    branches = [t for t in trajs if t.parent is not None]
    assert branches and stats["branches_per_tree"] == len(branches) / 2
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


def test_penalty_lowers_branch_concentration():
    gen = ScriptedGenerator(n_tools=5, entropy=lambda s: 2.0 * s)
    # h_root = 0 ≪ h_tool: m = 1, so the whole budget goes to branching
    no_penalty = [run(n_q=4, k=12, gen=gen, lam=0.0, seed=s)[1] for s in range(6)]
    penalty = [run(n_q=4, k=12, gen=gen, lam=0.5, seed=s)[1] for s in range(6)]
    assert all(st["m"] == 1 for st in no_penalty + penalty)
    hist_no = sum(sum(v for l, v in st["branch_l_hist"].items() if l >= 2) for st in no_penalty)
    hist_pen = sum(sum(v for l, v in st["branch_l_hist"].items() if l >= 2) for st in penalty)
    assert hist_pen < hist_no


def test_completion_adds_fresh_samples_not_duplicates():
    gen = ScriptedGenerator(n_tools=0, entropy=lambda s: 1.0)           # no tools → no branching
    trajs, stats = run(n_q=2, k=6, gen=gen)
    for g in range(2):
        group = [t for t in trajs if t.group_id == g]
        completions = [t for t in group if t.kind == "completion"]
        assert len(completions) == 6 - stats["m_per_question"][g]
        assert all(t.parent is None and t.fork_offset == 0 and t.round > 0 for t in completions)
        ids = [id(t.response_ids) for t in group]
        assert len(set(ids)) == 6                                      # no shared/copied objects
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
    assert shape(a) == shape(b) and sa == sb
    assert shape(a) != shape(c)


def test_tool_call_limit_and_token_budget():
    gen = ScriptedGenerator(n_tools=50, entropy=lambda s: 1.0)
    trajs, stats = run(n_q=1, k=2, gen=gen, entropy_branching=False, max_tool_calls=3,
                       max_response_tokens=100_000)
    t = trajs[0]
    assert "tool-call limit (3) reached" in t.text
    assert stats["tool_limit_hits"] > 0
    trajs, stats = run(n_q=1, k=2, gen=gen, entropy_branching=False, max_response_tokens=300)
    assert all(t.truncated and t.finish_reason == "length" and len(t.response_ids) <= 300 for t in trajs)
    assert stats["truncated_frac"] == 1.0


def test_stats_are_consistent():
    trajs, stats = run(n_q=3, k=8, gamma=1.0)
    n = len(trajs)
    assert stats["tool_calls_per_traj"] == pytest.approx(sum(len(t.tool_calls) for t in trajs) / n)
    assert stats["generated_tokens_per_traj"] == pytest.approx(sum(sum(t.loss_mask) for t in trajs) / n)
    assert sum(stats["branch_l_hist"].values()) == sum(t.parent is not None for t in trajs)
    assert 0 < stats["shared_prefix_frac"] < 1
    # a branch inherits its parent's calls up to the fork; only the calls after it were executed
    executed = sum(len(t.tool_calls) - TOK.decode(t.response_ids[:t.fork_offset]).count("<result>")
                   for t in trajs)
    assert stats["tools/search/calls"] == executed
