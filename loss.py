"""Token entropy and log-probs (chunked over the vocabulary) and the entropy-balanced policy loss of AEPO, with the
baselines' objectives as switches of the same function.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3.3 (entropy-balanced
policy optimisation); algorithm.md §1 (token entropy), §4 (loss) and §7 (baselines). The PPO/GRPO clipped surrogate
drops the gradient of every token whose ratio overshoots the upper bound, and those are mostly high-entropy,
exploratory tokens. AEPO writes the upper bound as (1+eps_high)·r/sg(r), which equals 1+eps_high in value but keeps a
bounded gradient (weight 1+eps_high) for those tokens; everything else is the dual-clip PPO objective
(`aepo_surrogate`). GPPO's and CISPO's surrogates sit beside it; `policy_loss` composes a surrogate, the aggregation
(verl's modes), the KL to a reference and the entropy bonus. This file copies alone (torch only).

Deviations from the paper / official code (algorithm.md §8): D18 (every normaliser of a mini-batch, N_valid, N_seq
and seq-mean-token-sum-norm's constant length, global and passed in; verl 0.4 aggregates per micro-batch and, for
seq-mean-token-sum-norm, divides by the micro-batch's padded length), D19 (the log-ratio clamped to [-20, 20] before
exp and 0 at mask-0 tokens, a safeguard neither official loss has; k3 clamped to [-10, 10] as the official
low_var_kl), D20 (token entropy over the full vocabulary in float32, chunk by chunk from the hidden states), D21 (the
entropy bonus a setting of its own), D22 (CISPO's lower bound off through eps_low = 1).
"""
from dataclasses import dataclass

import torch


def check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ValueError naming `name` and how many of its entries (those where mask is 1, if given) are nan or inf.
    A meta tensor has no values to check."""
    if not tensor.is_floating_point() or tensor.is_meta:
        return
    checked = torch.ones_like(tensor, dtype=torch.bool) if mask is None else mask.bool()
    bad = int((~torch.isfinite(tensor) & checked).sum())
    if bad:
        raise ValueError(f"{name}: {bad} of {int(checked.sum())} entries are non-finite (nan/inf)")


# ---------------------------------------------------------------------------------------------
# Entropy and log-probs (algorithm.md §1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Eq.: H_t = -Σ_v p_t(v) log p_t(v), p_t = softmax(z_t / T), over the full vocabulary.

    logits: (..., V) any float dtype. Returns (...) float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Eq.: log p_t(y_t) = z_t[y_t]/T - logsumexp(z_t/T).

    logits: (..., V); ids: (...) int64 token ids. Returns (...) float32."""
    z = logits.float() / temperature
    return z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """log p(y) and H per token from hidden states and the LM-head weight, `chunk` tokens at a time.

    Forward keeps only (N,) outputs and the per-token logsumexp; backward recomputes each chunk's
    logits. Per chunk, with z = h·Wᵀ/T and p = softmax(z):
        ∂logp/∂z = onehot(y) - p,    ∂H/∂z = -p ⊙ (log p + H),
    and ∂/∂h = g_z·W/T, ∂/∂W = g_zᵀ·h/T. Peak extra memory: one (chunk, V) float32 tensor (two in
    backward when the entropy output carries a gradient), plus, for weight, the (V, D) float32
    gradient accumulator (and a float32 copy of W when W is bf16/fp16)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, chunk):
        with torch.autocast(hidden.device.type, enabled=False):     # float32 even inside autocast
            return _ChunkedLogprobEntropy._forward(ctx, hidden, weight, ids, temperature, chunk)

    @staticmethod
    def _forward(ctx, hidden, weight, ids, temperature, chunk):
        ctx.set_materialize_grads(False)
        w32 = weight.float()
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = hidden[s:s + chunk].float() @ w32.T                 # (C, V)
            z.mul_(1.0 / temperature)
            zmax = z.max(-1, keepdim=True).values
            z.sub_(zmax)                                             # z' = z - max
            z_y = z.gather(-1, ids[s:s + chunk, None]).squeeze(-1)
            e = z.exp_()                                             # in place: one (C, V) tensor
            sum_e = e.sum(-1)
            log_sum = sum_e.log()
            sum_ez = e.xlogy_(e).sum(-1)                             # Σ e^z'·z'
            logp[s:s + chunk] = z_y - log_sum
            entropy[s:s + chunk] = log_sum - sum_ez / sum_e          # H = lse' - Σ p z'
            lse[s:s + chunk] = log_sum + zmax.squeeze(-1)
            del z, e
        ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ids)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return _ChunkedLogprobEntropy._backward(ctx, g_logp, g_entropy)

    @staticmethod
    def _backward(ctx, g_logp, g_entropy):
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_entropy is None) or not (need_h or need_w):
            return None, None, None, None, None
        temperature, chunk = ctx.temperature, ctx.chunk
        w32 = weight.float()
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(w32.shape, dtype=torch.float32, device=w32.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk].float()
            logp_all = h @ w32.T                                     # (C, V)
            logp_all.mul_(1.0 / temperature).sub_(lse[s:s + chunk, None])   # log p
            # g_z = g_logp·(onehot - p) + g_H·(-p ⊙ (log p + H)) = -p ⊙ (g_logp + g_H (log p + H)) + g_logp·onehot
            if g_entropy is not None:
                p = logp_all.exp()                                   # second (C, V) tensor
                gz = logp_all.add_(entropy[s:s + chunk, None]).mul_(g_entropy[s:s + chunk, None])
                if g_logp is not None:
                    gz.add_(g_logp[s:s + chunk, None])
                gz.mul_(p).neg_()
            else:
                p = logp_all.exp_()                                  # in place: one (C, V) tensor
                gz = p.mul_(g_logp[s:s + chunk, None]).neg_()
            del p, logp_all
            if g_logp is not None:
                gz.scatter_add_(-1, ids[s:s + chunk, None], g_logp[s:s + chunk, None].float())
            gz.mul_(1.0 / temperature)                               # ∂z/∂(h·Wᵀ) = 1/T
            if need_h:
                grad_h[s:s + chunk] = gz @ w32
            if need_w:
                grad_w.addmm_(gz.T, h)
            del gz
        return (grad_h.to(hidden.dtype) if need_h else None,
                grad_w.to(weight.dtype) if need_w else None, None, None, None)


def logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                         temperature: float = 1.0, chunk_size: int = 1024):
    """Memory-bounded log p(y_t) and H_t (algorithm.md §1) from the final hidden states.

    Eq.: z_t = h_t·Wᵀ / T,  logp_t = log softmax(z_t)[y_t],  H_t = -Σ_v p_t(v) log p_t(v).
    hidden: (N, D) final hidden states (any float dtype); weight: (V, D) LM-head weight;
    ids: (N,) int64 target token ids. Returns (logp (N,), entropy (N,)), both float32.
    Computed in float32 `chunk_size` tokens at a time, recomputing the chunk logits in backward,
    so one (chunk_size, V) float32 tensor exists at a time (two in backward if entropy needs grad).
    Gradients (in the input dtypes) flow to hidden and weight through both outputs; the trainer
    normally uses entropy detached (logging and the entropy-aware advantage), which costs nothing.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, D) and weight (V, D) expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if ids.shape != hidden.shape[:1]:
        raise ValueError(f"ids must have shape ({hidden.shape[0]},), got {tuple(ids.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedLogprobEntropy.apply(hidden, weight, ids.long(), float(temperature), int(chunk_size))


# ---------------------------------------------------------------------------------------------
# Entropy-balanced policy loss (algorithm.md §4)


LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(values, mask, n_valid, loss_agg="token-mean", n_seqs=None, max_len=None, scale=1.0):
    """verl's loss aggregations, with every normaliser global and passed in:

    token-mean:              scale · Σ_{b,t} x·m / N_valid
    seq-mean-token-sum:      scale · Σ_b (Σ_t x·m) / N_seq
    seq-mean-token-mean:     scale · Σ_b (Σ_t x·m / n_b) / N_seq,   n_b = Σ_t m_{b,t} (this row's own count)
    seq-mean-token-sum-norm: scale · Σ_{b,t} x·m / (N_seq · L)       (Dr. GRPO: a constant divisor)
    values: (B, T) per-token x; mask: (B, T), 1 = token sampled by the policy; n_valid: N_valid, mask-1 tokens
    of the whole optimiser mini-batch on all ranks; n_seqs: N_seq, its sequences (seq-mean-*); max_len: L, a
    constant such as max_response_tokens (seq-mean-token-sum-norm); scale: the coefficient in front (-1 for
    the policy loss, kl_coef, -entropy_coeff). A sequence is never split, so n_b is local. Returns 0-d."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}; got {loss_agg!r}")
    masked = torch.where(mask.bool(), values, 0.0)
    if loss_agg == "token-mean":
        return scale * masked.sum() / n_valid
    if not (n_seqs is not None and n_seqs > 0):
        raise ValueError(f"loss_agg={loss_agg!r} needs n_seqs > 0 (global count of sequences), got {n_seqs}")
    if loss_agg == "seq-mean-token-mean":
        total = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:
        total = masked.sum()
    if loss_agg == "seq-mean-token-sum-norm":
        if not (max_len is not None and max_len > 0):
            raise ValueError(f"loss_agg='seq-mean-token-sum-norm' needs max_len > 0 (a constant length), got {max_len}")
        return scale * total / (float(n_seqs) * float(max_len))
    return scale * total / float(n_seqs)


def aepo_surrogate(ratio, adv, eps_low=0.2, eps_high=0.2, clip_c=3.0, sg_clip=True):
    """Eq. (algorithm.md §4): upper = (1+ε_h)·r/sg(r)  (sg_clip=False: PPO's 1+ε_h),
         J = min(r·Ã, clip(r, 1−ε_l, upper)·Ã),  J = max(J, c·Ã) where Ã < 0  (dual clip).
    ratio: (B, T) r = π_θ/π_old, carrying the gradient; adv: (B, T) Ã. Returns J (B, T)."""
    r_sg = ratio.detach()                                                    # sg(.)
    upper = (1.0 + eps_high) * ratio / r_sg if sg_clip else torch.full_like(ratio, 1.0 + eps_high)
    # clip(r, 1 − ε_l, upper), written with where so that the gradient of the sg bound survives past it
    r_clip = torch.where(r_sg > 1.0 + eps_high, upper, torch.where(r_sg < 1.0 - eps_low, 1.0 - eps_low, ratio))
    return clipped_objective(ratio, r_clip, adv, clip_c)


def gppo_surrogate(ratio, adv, eps_low=0.2, eps_high=0.2, clip_c=3.0, sg_clip=True):
    """GPPO (arXiv:2508.07629): the lower bound keeps a gradient too, clip(r, (1−ε_l)·r/sg(r), (1+ε_h)·r/sg(r))
    (sg_clip=False: PPO's upper bound 1+ε_h); the min and the dual clip as AEPO's. ratio, adv: (B, T). Returns J."""
    r_sg = ratio.detach()                                                    # sg(.)
    upper = (1.0 + eps_high) * ratio / r_sg if sg_clip else torch.full_like(ratio, 1.0 + eps_high)
    lower = (1.0 - eps_low) * ratio / r_sg
    r_clip = torch.where(r_sg > 1.0 + eps_high, upper, torch.where(r_sg < 1.0 - eps_low, lower, ratio))
    return clipped_objective(ratio, r_clip, adv, clip_c)


def clipped_objective(ratio, r_clip, adv, clip_c=3.0):
    """Eq.: J = min(r·Ã, r_clip·Ã), then J = max(J, c·Ã) where Ã < 0 (the dual clip). All (B, T); returns J."""
    j = torch.where(ratio * adv <= r_clip * adv, ratio * adv, r_clip * adv)
    return torch.where((adv < 0) & (j < clip_c * adv), clip_c * adv, j)


def cispo_surrogate(ratio, logp, adv, eps_low=1.0, eps_high=0.28):
    """CISPO (arXiv:2506.13585): J = sg(clip(r, 1−ε_l, 1+ε_h))·Ã·log π_θ, no min and no dual clip, so every token keeps
    the gradient weight clip(r)·Ã. ratio, logp, adv: (B, T). Returns J (B, T)."""
    is_weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)          # sg(clip(r))
    return is_weight * adv * logp


def clip_metrics(ratio, log_ratio, adv, valid, eps_low, eps_high, clip_c, kept_hi, kept_lo, dual_clip) -> dict:
    """Detached float64 sums over the mask-1 tokens of one call (docs/reference.md defines each): the regions of r,
    the same for every variant, and what the variant did there. kept_hi / kept_lo: the upper / lower clip keeps a
    gradient (AEPO: upper; GPPO and CISPO: both); dual_clip: the dual clip drops one (all but CISPO)."""
    m = valid.double()
    rd, pos, neg = ratio.detach().double(), (adv > 0).double() * m, (adv < 0).double() * m
    clip_hi = (pos * (rd > 1.0 + eps_high)).sum()                           # Ã > 0, r > 1 + ε_h
    clip_lo = (neg * (rd < 1.0 - eps_low)).sum()                            # Ã < 0, r < 1 − ε_l
    clip_dual = (neg * (rd > clip_c)).sum()                                 # Ã < 0, r > c
    zero = torch.zeros_like(clip_hi)
    kept = (clip_hi if kept_hi else zero) + (clip_lo if kept_lo else zero)
    dropped = (zero if kept_hi else clip_hi) + (zero if kept_lo else clip_lo) + (clip_dual if dual_clip else zero)
    return {"n_tokens": m.sum(), "clip_hi": clip_hi, "clip_lo": clip_lo, "clip_dual": clip_dual,
            "out_hi": (m * (rd > 1.0 + eps_high)).sum(), "out_lo": (m * (rd < 1.0 - eps_low)).sum(),
            "preserved": clip_hi if kept_hi else zero, "grad_kept": kept, "grad_dropped": dropped,
            "approx_kl": ((rd - 1.0 - log_ratio.detach().double()) * m).sum(), "ratio": (rd * m).sum()}


SURROGATES = ("aepo", "gppo", "cispo")


@dataclass(frozen=True)
class LossSettings:
    """The objective, chosen once at set-up (algorithm.md §4, §7): the surrogate J (`aepo_surrogate`,
    `gppo_surrogate`, `cispo_surrogate`), the sg_clip switch (the stop-gradient upper bound; off: PPO's clip), ε_l, ε_h
    and dual-clip c, the KL and entropy-bonus coefficients, the aggregation (`aggregate`; max_len for
    seq-mean-token-sum-norm)."""
    surrogate: str = "aepo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_c: float = 3.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    max_len: int | None = None
    sg_clip: bool = True                     # last, so that the fields before it keep their positions

    def __post_init__(self):
        if self.surrogate not in SURROGATES:
            raise ValueError(f"surrogate must be one of {', '.join(SURROGATES)}; got {self.surrogate!r}")
        if not isinstance(self.sg_clip, bool):
            raise TypeError(f"sg_clip is a switch, True or False; got {self.sg_clip!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}; got {self.loss_agg!r}")


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Eq.: log r_t = clamp(log π_θ(y_t) − log π_old(y_t), −20, 20) where valid, else 0 (D19); r = exp(log r).
    logp: (B, T) current-policy log-probs (carry the gradient); old_logp: (B, T) behaviour policy; valid: (B, T)
    bool, True = token sampled by the policy. Returns (B, T) float32."""
    return torch.where(valid, (logp.float() - old_logp.float()).clamp(-20.0, 20.0), 0.0)


def k3(logp: torch.Tensor, ref_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Eq.: k3_t = clamp(e^d − d − 1, −10, 10), d = clamp(log π_ref(y_t) − log π_θ(y_t), −20, 20) where valid,
    else 0 (so k3 = 0 there): the low-variance estimate of KL(π_θ‖π_ref), verl's low_var_kl (D19).
    logp: (B, T) current-policy log-probs (carry the gradient); ref_logp: (B, T) the frozen reference's; valid: (B, T)
    bool, True = token sampled by the policy. Returns (B, T) float32."""
    d = torch.where(valid, (ref_logp.float() - logp.float()).clamp(-20.0, 20.0), 0.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


def policy_loss(logp, old_logp, advantages, mask, n_valid, settings: LossSettings = LossSettings(), *,
                ref_logp=None, entropy=None, n_seqs=None, weights=None):
    """Eq. (algorithm.md §4): r = exp(`log_ratio`); loss = aggregate(−J) + kl_coef·aggregate(`k3`)
    − entropy_coef·aggregate(H), J the settings' surrogate; aggregate: token-mean Σ·mask / n_valid (or verl's).
    logp: (B, T) current-policy log-probs (carry gradient); old_logp: (B, T) behaviour policy; advantages: (B, T) Ã,
    or (B,) one per sequence (TRL's), broadcast over T; mask: (B, T), 1 = token sampled by the policy; n_valid:
    mask-1 tokens of the whole optimiser mini-batch (all micro-batches and ranks); ref_logp: (B, T) frozen reference
    (k3 always reported, in the loss when kl_coef > 0); entropy: (B, T) current-policy H with its gradient (in the
    loss when entropy_coef != 0); n_seqs: sequences of the mini-batch (seq-mean-*); weights: (B, T) detached
    per-token factors of J (harness/mismatch.py's correction), None = 1.
    Returns (loss 0-d, metrics): `clip_metrics`' sums, and "kl_ref" (Σ k3), "pg_loss", "kl_loss", "entropy_loss"
    (this call's additive parts of the loss); sum them over micro-batches and ranks, divide by the global count."""
    s = settings
    advantages, n_valid = check_inputs(logp, old_logp, advantages, mask, n_valid, s, ref_logp, entropy, weights)
    agg = dict(n_valid=n_valid, loss_agg=s.loss_agg, n_seqs=n_seqs, max_len=s.max_len)
    valid, adv = mask.bool(), advantages.float()
    log_r = log_ratio(logp, old_logp, valid)
    ratio = torch.exp(log_r)
    if s.surrogate == "cispo":
        j = cispo_surrogate(ratio, logp.float(), adv, s.eps_low, s.eps_high)
    elif s.surrogate == "gppo":
        j = gppo_surrogate(ratio, adv, s.eps_low, s.eps_high, s.clip_c, s.sg_clip)
    else:
        j = aepo_surrogate(ratio, adv, s.eps_low, s.eps_high, s.clip_c, s.sg_clip)
    if weights is not None:
        w_sg = weights.detach()                                              # sg(.): the rollout correction
        j = j * w_sg
    pg_loss = aggregate(j, valid, scale=-1.0, **agg)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    kl_ref, kl_loss, entropy_loss = zero, zero, zero
    if ref_logp is not None:
        kl = k3(logp, ref_logp, valid)                                       # KL(π_θ‖π_ref) per token
        kl_ref = torch.where(valid, kl, 0.0).sum()
        kl_loss = aggregate(kl, valid, scale=s.kl_coef, **agg) if s.kl_coef else zero
    if entropy is not None and s.entropy_coef:
        entropy_loss = aggregate(entropy.float(), valid, scale=-s.entropy_coef, **agg)   # bonus: −c·H
    metrics = clip_metrics(ratio, log_r, adv, valid, s.eps_low, s.eps_high, s.clip_c,
                           kept_hi=s.sg_clip or s.surrogate == "cispo", kept_lo=s.surrogate in ("gppo", "cispo"),
                           dual_clip=s.surrogate != "cispo")
    metrics.update({name: value.detach().double() for name, value in
                    (("kl_ref", kl_ref), ("pg_loss", pg_loss), ("kl_loss", kl_loss), ("entropy_loss", entropy_loss))})
    return pg_loss + kl_loss + entropy_loss, metrics


def check_inputs(logp, old_logp, advantages, mask, n_valid, settings, ref_logp=None, entropy=None, weights=None):
    """policy_loss's inputs checked, each problem a specific error: settings a LossSettings, every tensor (B, T) like
    logp (advantages (B,), one per sequence, broadcast to it), the tensors finite (entropy at mask-1 tokens, when in
    the loss), n_valid > 0. Returns (advantages (B, T), n_valid as a float)."""
    shape = logp.shape
    if not isinstance(settings, LossSettings):
        raise TypeError(f"settings must be a loss.LossSettings (the clip bounds, surrogate and coefficients), got "
                        f"{type(settings).__name__}")
    if advantages.dim() == 1 and len(shape) == 2 and advantages.shape[0] == shape[0]:
        advantages = advantages[:, None].expand(shape)                       # one advantage per sequence
    for name, t in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages), ("mask", mask),
                    ("ref_logp", ref_logp), ("entropy", entropy), ("weights", weights)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")
        if t is not None and name not in ("entropy", "weights"):
            check_finite(name, t)
    if entropy is not None and settings.entropy_coef:
        check_finite("entropy (mask-1 tokens)", entropy, mask)
    n_valid = float(n_valid)
    if not n_valid > 0:
        raise ValueError(f"n_valid must be > 0 (global count of mask-1 tokens), got {n_valid}")
    return advantages, n_valid

