"""Group-relative outcome advantage and the entropy-aware advantage of AEPO, and the baselines' advantages.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3.3 (entropy-aware
advantage estimation); algorithm.md §3 and §7. Each trajectory's reward is z-scored within the group of k
trajectories of its question (GRPO) and broadcast to its policy tokens. AEPO then scales each token's advantage by
1 + alpha·sg(z(H)), where z(H) is the token's entropy z-scored over the batch, so confident-but-wrong and
uncertain-but-right tokens are weighted apart. The baselines the paper compares against are here too, as pure
functions: Dr. GRPO (`std_norm=False`), REINFORCE++, DAPO's dynamic sampling and overlong penalty, and GiGPO's step
advantage over the tree's shared states. Batch statistics are passed in (the trainer sums them over ranks), so this
file copies alone (torch only).

Deviations from the paper / official code (algorithm.md §8): D16 (the old policy's entropy, z-scored over the batch
on all ranks, Bessel-corrected), D17 (equal rewards and groups of one give exactly 0), D22 (the REINFORCE++ return
over policy tokens only, DAPO's dynamic sampling, GiGPO with γ = 1 and token-prefix states).
"""
import torch


def check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ValueError naming `name` and how many of its entries (those where mask is 1, if given) are nan or inf
    (the same as loss.check_finite). A meta tensor has no values to check."""
    if not tensor.is_floating_point() or tensor.is_meta:
        return
    checked = torch.ones_like(tensor, dtype=torch.bool) if mask is None else mask.bool()
    bad = int((~torch.isfinite(tensor) & checked).sum())
    if bad:
        raise ValueError(f"{name}: {bad} of {int(checked.sum())} entries are non-finite (nan/inf)")


# ---------------------------------------------------------------------------------------------
# Outcome advantage (algorithm.md §3a) and the entropy-aware advantage (algorithm.md §3b)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std_norm: bool = True) -> torch.Tensor:
    """Eq.: A_j = (R_j - mean_g R) / (std_g R + 1e-6), std Bessel-corrected, per group g;
    std_norm=False (Dr. GRPO, verl's norm_adv_by_std_in_grpo=False): A_j = R_j - mean_g R.

    rewards: (N,) one scalar reward per trajectory; group_ids: (N,) integer question id of each
    trajectory. Returns (N,) in the rewards' float dtype (float32 for integer rewards); a group of
    equal rewards, or of one trajectory, gives 0."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    check_finite("rewards", rewards)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.double()
    g, n_groups = _group_index(group_ids.to(r.device))
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=g.device)
    count = zeros.index_add(0, g, torch.ones_like(r))
    mean = zeros.index_add(0, g, r) / count
    dev = r - mean[g]
    var = zeros.index_add(0, g, dev * dev) / (count - 1).clamp(min=1)
    flat = ~_varied(r, g, n_groups)              # all equal, or a group of one
    adv = torch.where(flat, 0.0, dev / (var.sqrt()[g] + 1e-6) if std_norm else dev)
    return adv.to(out_dtype)


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(index 0..n-1 of each entry's group, n): the groups numbered in sorted order of their ids."""
    _, g = torch.unique(group_ids, return_inverse=True)
    return g, int(g.max().item()) + 1 if g.numel() else 0


def _varied(r: torch.Tensor, g: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(N,) bool: True where the entry's group has rewards that differ (max > min; never for a group of one)."""
    rmax = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, g, r, "amax")
    rmin = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, g, r, "amin")
    return (rmax > rmin)[g]


def token_stats(values: torch.Tensor, mask: torch.Tensor, name: str = "values") -> torch.Tensor:
    """[count, Σ x, Σ x²] over mask-1 tokens, float64 (sum it over micro-batches and ranks).

    values: (B, T) any per-token quantity x (entropy, REINFORCE++ returns); mask: (B, T), 1 = token
    sampled by the policy; name: what `values` is, for the error message."""
    if values.shape != mask.shape:
        raise ValueError(f"{name} {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    x = values.detach().double()[mask.bool()]
    check_finite(f"{name} (mask-1 tokens)", x)
    return torch.stack([x.new_tensor(float(x.numel())), x.sum(), (x * x).sum()])


def entropy_stats(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[count, Σ H, Σ H²] over mask-1 tokens, float64 (sum it over micro-batches and ranks).

    entropy: (B, T) token entropy; mask: (B, T), 1 = token sampled by the policy."""
    return token_stats(entropy, mask, "entropy")


def mean_std(stats: torch.Tensor) -> tuple[float, float]:
    """(mean, std) from `token_stats` / `entropy_stats` [count, sum, sumsq]; std is Bessel-corrected.

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

    advantages: (B, T) per token, or (B,) / (B, 1) per trajectory (broadcast over tokens); entropy: (B, T)
    old-policy token entropy; mask: (B, T), 1 = token sampled by the policy; mean, std: batch
    statistics of H over all mask-1 tokens on all ranks (`mean_std`). Returns (B, T) float32."""
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have the same shape")
    advantages = advantages.reshape(len(advantages), -1)                  # (B,) -> (B, 1), broadcast over tokens
    if advantages.shape[0] != entropy.shape[0] or advantages.shape[1] not in (1, entropy.shape[1]):
        raise ValueError(f"advantages {tuple(advantages.shape)} do not match entropy {tuple(entropy.shape)}")
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    valid = mask.bool()
    check_finite("advantages", advantages)
    check_finite("entropy (mask-1 tokens)", entropy, valid)
    z = (torch.where(valid, entropy.float(), mean) - mean) / std      # padding entries -> z = 0
    z = z.detach()                                                           # sg(.)
    out = advantages.float() * (1.0 + alpha * z)
    return torch.where(valid, out, 0.0)


# ---------------------------------------------------------------------------------------------
# REINFORCE++ (arXiv:2501.03262): token-level KL in the reward, batch-global normalisation


def reinforce_pp_returns(rewards: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor | None = None,
                         ref_logp: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
    """Eq.: r_t = -beta·KL_t·m_t + R·[t = last mask-1 token],  KL_t = sg(log π_old(y_t) - log π_ref(y_t)) (k1),
         G_t = Σ_{t' >= t} r_t'  (γ = 1) at mask-1 tokens, 0 elsewhere.

    rewards: (B,) outcome reward per trajectory; mask: (B, T), 1 = token sampled by the policy (tool-output
    tokens have r = 0: they neither add to the return nor cut it); old_logp, ref_logp: (B, T) behaviour and
    reference log-probs (both or neither; neither = no KL). Returns (B, T) float32, no gradient."""
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards (B,) and mask (B, T) expected, got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    if (old_logp is None) != (ref_logp is None):
        raise ValueError("old_logp and ref_logp go together: pass both (KL in the reward) or neither")
    check_finite("rewards", rewards)
    valid = mask.bool()
    r = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if ref_logp is not None:
        for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp)):
            if t.shape != mask.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(mask.shape)} like mask")
            check_finite(f"{name} (mask-1 tokens)", t, valid)
        kl = old_logp.double() - ref_logp.double()
        kl = kl.detach()                                                     # sg(.)
        r = torch.where(valid, -beta * kl, 0.0)
    rows = valid.any(1)
    last = mask.shape[1] - 1 - valid.flip(1).int().argmax(1)                # index of the last mask-1 token
    r[rows, last[rows]] += rewards.detach().double().to(r.device)[rows]
    returns = r.flip(1).cumsum(1).flip(1)                                    # Σ_{t' >= t} r_t'
    return torch.where(valid, returns, 0.0).float()


def reinforce_pp_advantages(returns: torch.Tensor, mask: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """Eq.: A_t = (G_t - mean) / (std + 1e-6) at mask-1 tokens, 0 elsewhere.

    returns: (B, T) G_t from `reinforce_pp_returns`; mask: (B, T), 1 = token sampled by the policy;
    mean, std: over all mask-1 tokens of the training batch on all ranks, as verl and OpenRLHF normalise
    (no per-group baseline): mean_std(all-reduced token_stats(returns, mask)). Returns (B, T) float32."""
    if returns.shape != mask.shape:
        raise ValueError(f"returns {tuple(returns.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    valid = mask.bool()
    check_finite("returns (mask-1 tokens)", returns, valid)
    g = returns.detach()                                                     # sg(.)
    return torch.where(valid, (g.double() - mean) / (std + 1e-6), 0.0).float()


# ---------------------------------------------------------------------------------------------
# DAPO (arXiv:2503.14476): dynamic sampling and overlong reward shaping


def dynamic_sampling_mask(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Eq.: keep group g iff its rewards are not all equal (std_g R > 0); the trainer refills the batch.

    rewards: (N,) one reward per trajectory; group_ids: (N,) question id. Returns (N,) bool, True for every
    trajectory of a kept group (a group of one is dropped: its advantage is 0)."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    check_finite("rewards", rewards)
    r = rewards.detach().double()
    g, n_groups = _group_index(group_ids.to(r.device))
    return _varied(r, g, n_groups)


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """Eq. (DAPO, arXiv:2503.14476 §3.4, soft overlong punishment), added to the reward:
         R_len(L) = 0 if L <= L_max - L_cache;  ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max;
                    -1 if L > L_max;  i.e. clamp(((L_max - L_cache) - L) / L_cache, -1, 0).

    lengths: (N,) response length L of each trajectory in tokens (here: len(response_ids), tool results
    included, against the budget max_len = max_response_tokens); cache_len: L_cache, 0 < L_cache <= L_max.
    Returns (N,) float32."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    soft = ((max_len - cache_len) - lengths.double()) / cache_len
    return soft.clamp(-1.0, 0.0).float()


# ---------------------------------------------------------------------------------------------
# GiGPO (arXiv:2505.10978): episode-level plus step-level group advantage over shared states


def gigpo_advantages(response_ids: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, rewards: torch.Tensor,
                     omega: float = 1.0, std_norm: bool = True) -> torch.Tensor:
    """Eq.: A_{j,t} = A^E_j + omega·A^S_{j,s(t)} at mask-1 tokens, 0 elsewhere, where
         A^E_j = group_advantages(R)_j over the question's trajectories (episode level),
         A^S_{j,s} = group_advantages over the step group of step s of trajectory j: the trajectories i of the
                     same question with ids_i[:s] == ids_j[:s] (the same state: in the tree, j and the branches
                     forked from its path at or after s), each scored by its own R (γ = 1),
         a step s(t) = the start of the run of mask-1 tokens holding t (a policy segment between tool results).
    A step whose state nobody else reached gets A^S = 0; the first step (s = 0) is shared by the whole question.

    response_ids: (B, T) int token ids aligned with mask (response-only, or the trainer's input_ids[:, 1:] since
    a question's prompt is the same for all its trajectories; padding never reaches a compared prefix);
    mask: (B, T), 1 = token sampled by the policy; group_ids: (B,) question id; rewards: (B,) outcome reward;
    omega: step-advantage weight; std_norm: divide by the group std (False: verl-agent's "mean_norm").
    Returns (B, T) float32, no gradient."""
    if response_ids.shape != mask.shape or group_ids.shape != rewards.shape or rewards.shape != mask.shape[:1]:
        raise ValueError(f"need response_ids and mask (B, T), group_ids and rewards (B,); got "
                         f"{tuple(response_ids.shape)}, {tuple(mask.shape)}, {tuple(group_ids.shape)}, {tuple(rewards.shape)}")
    rewards = rewards.detach()                                               # sg(.)
    valid = mask.bool()
    starts = valid & ~torch.nn.functional.pad(valid, (1, 0))[:, :-1]         # first token of each run of mask 1
    owner, first, step_key = [], [], []                                     # one entry per step
    for question in group_ids.unique().tolist():
        rows = (group_ids == question).nonzero().flatten()
        ids = response_ids[rows]
        shared = (ids[:, None, :] == ids[None, :, :]).int().cumprod(-1).sum(-1)   # (k, k) common prefix lengths
        for k, row in enumerate(rows.tolist()):
            for start in starts[row].nonzero().flatten().tolist():
                same_state = int((shared[k] >= start).nonzero()[0])         # first of the question in this state
                owner.append(row)
                first.append(start)
                step_key.append((question, start, same_state))
    key_index = {key: i for i, key in enumerate(dict.fromkeys(step_key))}
    device = mask.device
    step_adv = group_advantages(rewards[owner], torch.tensor([key_index[k] for k in step_key], device=device),
                                std_norm)
    step_of = torch.zeros(mask.shape, dtype=torch.long, device=device)       # which step each position is in
    step_of[owner, first] = torch.arange(1, len(owner) + 1, device=device)
    step_of = step_of.cummax(1).values
    per_token = torch.cat([torch.zeros(1, device=device), step_adv.float()])[step_of]
    episode = group_advantages(rewards, group_ids, std_norm).float()
    return torch.where(valid, episode[:, None] + omega * per_token, 0.0)
