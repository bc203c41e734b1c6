"""Group-relative outcome advantage and the entropy-aware advantage of AEPO.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, §3.3
(entropy-aware advantage estimation); SPEC §3.

Mechanism: each trajectory's reward is z-scored within the group of k trajectories of its question
(GRPO) and broadcast to its policy tokens. AEPO then scales each token's advantage by
1 + alpha·sg(z(H)), where z(H) is the token's entropy z-scored over the batch, so confident-but-wrong
and uncertain-but-right tokens are weighted apart.

Deviations from the paper / official code:
1. H is the old-policy token entropy from the old-log-prob pass, and its mean/std are taken over
   all loss-mask-1 tokens of the training batch on all ranks (the trainer all-reduces
   `entropy_stats` and passes mean/std in), so the advantage does not depend on micro-batch size or
   world size. The official code z-scores current-policy entropy per micro-batch, and since it only
   computes entropy when entropy_coeff != 0 (0 in both released scripts) the reweighting never ran
   in the released runs.
2. std of the batch entropy is the sample (Bessel-corrected) std, like the outcome std; with fewer
   than two tokens or zero spread every z is 0.
3. A group whose rewards are all equal gets exactly 0, not a rounding residue divided by 1e-6; a group of one
   also gets 0 (SPEC §3a: nothing to compare with), where the official code takes the std of one element as 1
   and gives A = R / (1 + 1e-6).
"""
import torch

from loss import check_finite


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Eq.: A_j = (R_j - mean_g R) / (std_g R + 1e-6), std Bessel-corrected, per group g.

    rewards: (N,) one scalar reward per trajectory; group_ids: (N,) integer question id of each
    trajectory. Returns (N,) in the rewards' float dtype (float32 for integer rewards); a group of
    equal rewards, or of one trajectory, gives 0."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    check_finite("rewards", rewards)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    _, g = torch.unique(group_ids, return_inverse=True)
    n_groups = int(g.max().item()) + 1 if g.numel() else 0
    r = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, r) / count
    dev = r - mean[g]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, dev * dev) / (count - 1).clamp(min=1)
    rmax = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, g, r, "amax")
    rmin = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, g, r, "amin")
    flat = (rmax == rmin)[g]                     # all equal, or a group of one
    adv = torch.where(flat, 0.0, dev / (var.sqrt()[g] + 1e-6))
    return adv.to(out_dtype)


def entropy_stats(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[count, Σ H, Σ H²] over mask-1 tokens, float64 (sum it over micro-batches and ranks).

    entropy: (B, T) token entropy; mask: (B, T), 1 = token sampled by the policy."""
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have the same shape")
    h = entropy.detach().double()[mask.bool()]
    check_finite("entropy (mask-1 tokens)", h)
    return torch.stack([torch.tensor(float(h.numel()), dtype=torch.float64), h.sum(), (h * h).sum()])


def mean_std(stats: torch.Tensor) -> tuple[float, float]:
    """(mean, std) from `entropy_stats` [count, sum, sumsq]; std is Bessel-corrected.

    count < 2 or zero spread gives std = 1.0 (every z is then 0); count 0 gives mean 0.0."""
    count, total, sumsq = (float(x) for x in stats.double())
    if count <= 0:
        return 0.0, 1.0
    mean = total / count
    if count < 2:
        return mean, 1.0
    var = max((sumsq - total * mean) / (count - 1), 0.0)
    std = var ** 0.5
    return mean, (std if std > 0 else 1.0)


def entropy_weighted_advantages(advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                                mean: float, std: float, alpha: float = 0.2) -> torch.Tensor:
    """Eq.: Ã_{j,t} = A_j · (1 + alpha · sg((H_{j,t} - mean) / std)), 0 where mask == 0.

    advantages: (B,) per trajectory (broadcast over tokens) or (B, T) per token; entropy: (B, T)
    old-policy token entropy; mask: (B, T), 1 = token sampled by the policy; mean, std: batch
    statistics of H over all mask-1 tokens on all ranks (`mean_std`). Returns (B, T) float32."""
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if advantages.shape[0] != entropy.shape[0] or advantages.shape[1] not in (1, entropy.shape[1]):
        raise ValueError(f"advantages {tuple(advantages.shape)} do not match entropy {tuple(entropy.shape)}")
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    valid = mask.bool()
    check_finite("advantages", advantages)
    check_finite("entropy (mask-1 tokens)", entropy[valid])
    z = (torch.where(valid, entropy.float(), mean) - mean) / std      # padding entries -> z = 0
    z = z.detach()                                                           # sg(.)
    out = advantages.float() * (1.0 + alpha * z)
    return torch.where(valid, out, 0.0)
