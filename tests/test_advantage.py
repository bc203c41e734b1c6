"""advantage.py: GRPO group advantages and the entropy-aware advantage (values, sg on gradient), and the baselines'
advantages: Dr. GRPO, REINFORCE++, DAPO's dynamic sampling and overlong penalty, GiGPO (values by hand)."""
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import advantage as A


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.3, 0.3, 0.3, 7.0])
    groups = torch.tensor([5, 5, 5, 9, 9, 2, 2, 11])
    adv = A.group_advantages(rewards, groups)
    # group 5: mean 0.5, sample std 0.5
    assert torch.allclose(adv[:3], torch.tensor([0.5, -0.5, 0.0]) / (0.5 + 1e-6))
    # group 9: mean 1.15, sample std = |2 - 0.3| / sqrt 2
    s = 1.7 / math.sqrt(2)
    assert torch.allclose(adv[3:5], torch.tensor([0.85, -0.85]) / (s + 1e-6))
    assert torch.all(adv[5:7] == 0)                   # equal rewards -> exactly 0
    assert adv[7] == 0                                 # group of one -> 0
    assert adv.dtype == torch.float32


def test_group_advantages_equal_rewards_exactly_zero_and_int_rewards():
    adv = A.group_advantages(torch.full((3,), 0.1), torch.zeros(3, dtype=torch.long))
    assert torch.all(adv == 0)
    adv = A.group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.dtype == torch.float32 and adv[0] > 0 > adv[1]


def test_group_advantages_match_torch_std_per_group():
    torch.manual_seed(0)
    r = torch.randn(24)
    g = torch.arange(24) % 4
    adv = A.group_advantages(r, g)
    for k in range(4):
        rk = r[g == k]
        assert torch.allclose(adv[g == k], (rk - rk.mean()) / (rk.std() + 1e-6), atol=1e-6)


def test_group_advantages_non_finite_raises():
    with pytest.raises(ValueError, match="rewards: 1 of 2"):
        A.group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_entropy_stats_and_mean_std():
    h = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    stats = A.entropy_stats(h, mask)
    assert stats.dtype == torch.float64 and stats.tolist() == [4.0, 10.0, 30.0]
    mean, std = A.mean_std(stats)
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert mean == pytest.approx(2.5) and std == pytest.approx(ref.std().item())   # Bessel
    # stats are additive: split then sum == whole
    assert torch.allclose(A.entropy_stats(h[:1], mask[:1]) + A.entropy_stats(h[1:], mask[1:]), stats)
    assert A.mean_std(torch.tensor([0.0, 0.0, 0.0])) == (0.0, 1.0)
    assert A.mean_std(A.entropy_stats(torch.tensor([[2.0]]), torch.ones(1, 1))) == (2.0, 1.0)
    assert A.mean_std(A.entropy_stats(torch.full((2, 2), 3.0), torch.ones(2, 2))) == (3.0, 1.0)


def test_entropy_weighted_advantages_values_and_mask():
    adv = torch.tensor([2.0, -1.0])
    h = torch.tensor([[1.0, 3.0, 5.0], [3.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = A.entropy_weighted_advantages(adv, h, mask, mean=3.0, std=2.0, alpha=0.2)
    expected = torch.tensor([[2 * (1 - 0.2), 2.0, 2 * (1 + 0.2)], [-1.0, -(1 - 0.2), 0.0]])
    assert torch.allclose(out, expected)
    per_token = A.entropy_weighted_advantages(adv[:, None].expand(2, 3), h, mask, 3.0, 2.0)
    assert torch.allclose(per_token, out)
    assert torch.equal(A.entropy_weighted_advantages(adv, h, mask, 3.0, 2.0, alpha=0.0), adv[:, None] * mask)


def test_entropy_weighted_advantages_stop_gradient():
    torch.manual_seed(1)
    h = torch.rand(3, 5, requires_grad=True)
    adv = torch.randn(3, requires_grad=True)
    mask = (torch.rand(3, 5) > 0.3).float()
    out = A.entropy_weighted_advantages(adv, h, mask, 0.5, 0.3)
    assert out.grad_fn is not None                     # gradient still reaches the advantages
    out.sum().backward()
    assert h.grad is None                              # sg(.): nothing flows into the entropy
    z = (h.detach() - 0.5) / 0.3
    assert torch.allclose(adv.grad, ((1 + 0.2 * z) * mask).sum(1))


def test_entropy_weighted_advantages_split_invariance():
    torch.manual_seed(2)
    h = torch.rand(6, 10) * 3
    mask = (torch.rand(6, 10) > 0.25).float()
    adv = torch.randn(6)
    mean, std = A.mean_std(A.entropy_stats(h[:2], mask[:2]) + A.entropy_stats(h[2:], mask[2:]))
    whole = A.entropy_weighted_advantages(adv, h, mask, mean, std)
    parts = torch.cat([A.entropy_weighted_advantages(adv[s], h[s], mask[s], mean, std)
                       for s in (slice(0, 1), slice(1, 4), slice(4, 6))])
    assert torch.equal(whole, parts)


def test_entropy_weighted_advantages_bad_inputs():
    with pytest.raises(ValueError, match="entropy"):
        A.entropy_weighted_advantages(torch.zeros(2), torch.zeros(2, 3), torch.ones(2, 4), 0.0, 1.0)
    h = torch.zeros(1, 2)
    h[0, 0] = float("inf")
    with pytest.raises(ValueError, match="entropy .*1 of 1"):
        A.entropy_weighted_advantages(torch.zeros(1), h, torch.tensor([[1, 0]]), 0.0, 1.0)
    assert torch.equal(A.entropy_weighted_advantages(torch.ones(1), h, torch.tensor([[0, 1]]), 0.0, 1.0),
                       torch.tensor([[0.0, 1.0]]))


def test_advantage_module_imports_alone():
    """advantage.py needs no other module of the project (it has its own check_finite)."""
    code = "import sys, advantage; assert 'loss' not in sys.modules, sorted(m for m in sys.modules if '.' not in m)"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------
# Baselines (algorithm.md §7)


def test_dr_grpo_subtracts_the_mean_without_dividing_by_the_std():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.3, 0.3, 0.3, 7.0])
    groups = torch.tensor([5, 5, 5, 9, 9, 2, 2, 11])
    adv = A.group_advantages(rewards, groups, std_norm=False)
    # group 5: mean 0.5; group 9: mean 1.15; equal rewards and a group of one: exactly 0
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.85, -0.85, 0.0, 0.0, 0.0]))
    assert torch.all(adv[5:] == 0)
    assert torch.equal(A.group_advantages(rewards, groups, std_norm=True), A.group_advantages(rewards, groups))


def _rpp_inputs():
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    old = torch.tensor([[0.1, 0.2, 9.0, 0.3, float("inf")], [0.2, 0.0, -0.4, 0.0, 0.2], [0.0] * 5])
    return torch.tensor([1.0, -1.0, 5.0]), mask, old, torch.zeros(3, 5)


def test_reinforce_pp_returns_by_hand():
    """r_t = -β·(old - ref) at policy tokens, R added at the last one, G_t = Σ_{t'>=t} r_t'. β = 0.5:
    row 0: r = (-.05, -.1, [tool], -.15 + 1) -> G = (.70, .75, 0, .85, 0); row 1: r = (-.1, [tool], .2, 0, -.1 - 1)
    -> G = (-1.0, 0, -.9, -1.1, -1.1); a row without policy tokens has no return (its R goes nowhere)."""
    rewards, mask, old, ref = _rpp_inputs()
    g = A.reinforce_pp_returns(rewards, mask, old, ref, beta=0.5)
    expected = torch.tensor([[0.70, 0.75, 0.0, 0.85, 0.0], [-1.0, 0.0, -0.9, -1.1, -1.1], [0.0] * 5])
    assert g.dtype == torch.float32 and torch.allclose(g, expected, atol=1e-6)
    # no KL: G = R at every policy token (the tool token in row 0 does not cut the return)
    g0 = A.reinforce_pp_returns(rewards, mask)
    assert torch.equal(g0, torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [-1.0, 0.0, -1.0, -1.0, -1.0], [0.0] * 5]))
    with pytest.raises(ValueError, match="go together"):
        A.reinforce_pp_returns(rewards, mask, old)
    bad = old.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"old_logp \(mask-1 tokens\): 1 of"):
        A.reinforce_pp_returns(rewards, mask, bad, ref, beta=0.5)


def test_reinforce_pp_advantages_normalise_over_the_batch_and_carry_no_gradient():
    rewards, mask, old, ref = _rpp_inputs()
    old = old.clone().requires_grad_()
    g = A.reinforce_pp_returns(rewards, mask, old, ref, beta=0.5)
    assert not g.requires_grad                                       # sg(.): the KL in the reward is a constant
    values = [0.70, 0.75, 0.85, -1.0, -0.9, -1.1, -1.1]              # the mask-1 returns, by hand above
    mean, std = statistics.mean(values), statistics.stdev(values)
    stats = A.token_stats(g[:1], mask[:1]) + A.token_stats(g[1:], mask[1:])     # summed over "ranks"
    got_mean, got_std = A.mean_std(stats)
    assert got_mean == pytest.approx(mean, abs=1e-6) and got_std == pytest.approx(std, abs=1e-6)
    adv = A.reinforce_pp_advantages(g.requires_grad_(), mask, got_mean, got_std)
    assert not adv.requires_grad
    expected = torch.zeros(3, 5)
    expected[mask.bool()] = torch.tensor([(v - mean) / (std + 1e-6) for v in values])
    assert torch.allclose(adv, expected, atol=1e-5)
    # row by row (micro-batches, ranks) with the global statistics: the same advantages
    parts = torch.cat([A.reinforce_pp_advantages(g[i:i + 1], mask[i:i + 1], got_mean, got_std) for i in range(3)])
    assert torch.equal(parts, adv)
    with pytest.raises(ValueError, match="std"):
        A.reinforce_pp_advantages(g, mask, 0.0, 0.0)


def test_dapo_dynamic_sampling_keeps_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 3.0, 0.0, 0.0, 1e-9])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3])
    keep = A.dynamic_sampling_mask(rewards, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, True, False, False, False, True, True, True]


def test_dapo_overlong_penalty_by_hand():
    """L_max = 20, L_cache = 4: 0 up to 16, then -1/4 per token, -1 at 20 and beyond."""
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = A.overlong_penalty(lengths, max_len=20, cache_len=4)
    assert torch.allclose(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    for cache in (0, 21):
        with pytest.raises(ValueError, match="cache_len"):
            A.overlong_penalty(lengths, 20, cache)


def _tree():
    """Question 0: a (global), b branched from a at offset 5, c branched from b at offset 8 (a branch of a
    branch), d global. Question 1: e, f with the same first 5 tokens as a (another question: never merged).
    Tool results (mask 0) at offsets 3-4 and 7; 0 pads."""
    a = [10, 11, 12, 90, 91, 13, 14, 92, 15, 16]
    b = a[:5] + [20, 21, 93, 22, 23]
    c = b[:8] + [30, 31]
    d = [40, 41, 42, 94, 95, 43, 44, 0, 0, 0]
    e = a[:5] + [50, 0, 0, 0, 0]
    f = a[:5] + [51, 0, 0, 0, 0]
    full = [1, 1, 1, 0, 0, 1, 1, 0, 1, 1]
    mask = torch.tensor([full, full, full, full[:7] + [0, 0, 0], full[:6] + [0] * 4, full[:6] + [0] * 4])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.0])
    return torch.tensor([a, b, c, d, e, f]), mask, torch.tensor([0, 0, 0, 0, 1, 1]), rewards


def test_gigpo_step_groups_on_a_hand_built_tree():
    """std_norm=False (mean only), omega = 1. Episode: q0 mean .375 -> a .625, b -.375, c .125, d -.375; q1 mean .5.
    Steps of q0: s=0 {a,b,c,d} (= episode); s=5 {a,b,c} (share 5 tokens) mean .5 -> a .5, b -.5, c 0;
    d's s=5 state is its own -> 0; s=8: a alone -> 0, {b,c} mean .25 -> b -.25, c .25.
    q1: s=0 and s=5 {e,f} mean .5 (a shares those 5 tokens but is another question)."""
    ids, mask, groups, rewards = _tree()
    adv = A.gigpo_advantages(ids, mask, groups, rewards, omega=1.0, std_norm=False)
    s0, s5, s8 = [0, 1, 2], [5, 6], [8, 9]
    expected = torch.zeros(6, 10)
    for row, (v0, v5, v8) in enumerate([(1.25, 1.125, 0.625), (-0.75, -0.875, -0.625), (0.25, 0.125, 0.375),
                                        (-0.75, -0.375, 0.0), (1.0, 1.0, 0.0), (-1.0, -1.0, 0.0)]):
        expected[row, s0], expected[row, s5], expected[row, s8] = v0, v5, v8
    expected *= mask
    assert adv.dtype == torch.float32 and torch.allclose(adv, expected, atol=1e-6)


def test_gigpo_with_std_and_omega_and_aligned_prompts():
    ids, mask, groups, rewards = _tree()
    adv = A.gigpo_advantages(ids, mask, groups, rewards, omega=0.5)
    sd = statistics.stdev
    ep_c = (0.5 - 0.375) / (sd([1, 0, 0.5, 0]) + 1e-6)
    assert adv[2, 0].item() == pytest.approx(ep_c + 0.5 * ep_c, abs=1e-5)                     # s=0 group = question
    assert adv[0, 5].item() == pytest.approx((0.625 / (sd([1, 0, 0.5, 0]) + 1e-6)) + 0.5 * 0.5 / (0.5 + 1e-6), abs=1e-5)
    assert adv[2, 5].item() == pytest.approx(ep_c, abs=1e-5)                                   # c is the {a,b,c} mean
    assert adv[2, 9].item() == pytest.approx(ep_c + 0.5 * 0.25 / (sd([0, 0.5]) + 1e-6), abs=1e-5)
    assert adv[0, 9].item() == pytest.approx(0.625 / (sd([1, 0, 0.5, 0]) + 1e-6), abs=1e-5)    # a alone at s=8
    # omega = 0: the episode advantage (GRPO) on every policy token
    plain = A.gigpo_advantages(ids, mask, groups, rewards, omega=0.0)
    assert torch.allclose(plain, A.group_advantages(rewards, groups)[:, None] * mask)
    # the trainer's layout: each question's prompt in front (mask 0), same for all its trajectories
    prompt = torch.tensor([[7, 7, 7]] * 4 + [[8, 8, 8]] * 2)
    shifted = A.gigpo_advantages(torch.cat([prompt, ids], 1), torch.cat([torch.zeros(6, 3, dtype=torch.long), mask], 1),
                                 groups, rewards, omega=0.5)
    assert torch.equal(shifted[:, 3:], adv) and torch.all(shifted[:, :3] == 0)


def test_gigpo_advantages_are_constants():
    ids, mask, groups, rewards = _tree()
    out = A.gigpo_advantages(ids, mask, groups, rewards.clone().requires_grad_())
    assert not out.requires_grad
    with pytest.raises(ValueError, match="response_ids"):
        A.gigpo_advantages(ids[:, :5], mask, groups, rewards)
