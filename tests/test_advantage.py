"""advantage.py: GRPO group advantages and the entropy-aware advantage (values, sg on gradient)."""
import math

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
