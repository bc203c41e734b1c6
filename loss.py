"""Token entropy and log-probs (chunked over the vocabulary) and the entropy-balanced policy loss of AEPO, with the
baselines' objectives as switches of the same function.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3.3 (entropy-balanced
policy optimisation); algorithm.md §1 (token entropy), §4 (loss) and §7 (baselines). The PPO/GRPO clipped surrogate
drops the gradient of every token whose ratio overshoots the upper bound, and those are mostly high-entropy,
exploratory tokens. AEPO writes the upper bound as (1+eps_high)·r/sg(r), which equals 1+eps_high in value but keeps a
bounded gradient (weight 1+eps_high) for those tokens; everything else is the dual-clip PPO objective. GPPO's lower sg
bound, CISPO, the entropy bonus and verl's loss aggregations are arguments of `policy_loss`. This file copies alone
(torch only).

Deviations from the paper / official code (algorithm.md §8): D16 (every normaliser of a mini-batch, N_valid, N_seq
and seq-mean-token-sum-norm's constant length, global and passed in; verl 0.4 aggregates per micro-batch and, for
seq-mean-token-sum-norm, divides by the micro-batch's padded length), D17 (the log-ratio clamped to [-20, 20] before
exp and 0 at mask-0 tokens, a safeguard neither official loss has; k3 clamped to [-10, 10] as the official
low_var_kl), D18 (token entropy over the full vocabulary in float32, chunk by chunk from the hidden states), D19 (the
entropy bonus a setting of its own), D20 (CISPO's lower bound off through eps_low = 1).
"""
import torch

# ---------------------------------------------------------------------------------------------
# Checks


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError naming `name` and how many of its entries are nan or inf."""
    bad = (~torch.isfinite(tensor)).sum().item() if tensor.is_floating_point() else 0
    if bad:
        raise ValueError(f"{name}: {bad} of {tensor.numel()} entries are non-finite (nan/inf)")


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


def policy_loss(logp, old_logp, advantages, mask, n_valid, eps_low=0.2, eps_high=0.2, clip_c=3.0,
                sg_clip=True, ref_logp=None, kl_coef=0.0, *, sg_clip_low=False, cispo=False, entropy=None,
                entropy_coeff=0.0, loss_agg="token-mean", n_seqs=None, max_len=None):
    """AEPO clipped surrogate with stop-gradient upper bound and dual clip, and the baselines' switches.

    Eq.: r = exp(logp - old_logp),  upper = (1+eps_high)·r/sg(r)  (sg_clip) or 1+eps_high,
         lower = (1-eps_low)·r/sg(r)  (sg_clip_low, GPPO) or 1-eps_low,
         J = min(r·Ã, clip(r, lower, upper)·Ã);  J = max(J, clip_c·Ã) where Ã < 0,
         CISPO (cispo): J = sg(clip(r, 1-eps_low, 1+eps_high))·Ã·logp  (no min, no dual clip),
         loss = aggregate(-J) + kl_coef·aggregate(k3) - entropy_coeff·aggregate(H),
         k3 = clamp(e^(ref-logp) - (ref-logp) - 1, -10, 10)  (verl's low_var_kl);
         aggregate = token-mean Σ·mask / n_valid by default (`aggregate` lists verl's other modes).
    logp: (B, T) current-policy log-probs (carry gradient); old_logp: (B, T) behaviour-policy
    log-probs; advantages: (B, T) per-token Ã; mask: (B, T), 1 = token sampled by the policy
    (counts in the loss), 0 = prompt/tool output/padding; n_valid: number of mask-1 tokens of the
    whole optimiser mini-batch over all micro-batches and ranks; ref_logp: (B, T) frozen reference
    log-probs (its k3 is always reported; it enters the loss only when kl_coef > 0); entropy: (B, T)
    current-policy token entropy H, with its gradient (`logprobs_and_entropy`); it enters the loss only
    when entropy_coeff != 0; loss_agg, n_seqs, max_len: see `aggregate`. GPPO = sg_clip and sg_clip_low;
    CISPO ignores sg_clip, sg_clip_low and clip_c (MiniMax-M1 sets no lower bound: eps_low >= 1).
    The two sg bounds never meet the dual clip: it acts where Ã < 0 and r > clip_c (> 1), the lower
    bound where r < 1-eps_low, so Ã < 0 ∧ r > clip_c still gets no gradient under GPPO.
    Per-token gradient (token-mean): ∂loss/∂logp = -F·Ã·mask/n_valid with F = 1+eps_high (sg_clip,
    Ã>0, r>1+eps_high), 1-eps_low (sg_clip_low, Ã<0, r<1-eps_low), 0 for the other clipped cases and
    the dual clip, r otherwise; under CISPO F = clip(r, 1-eps_low, 1+eps_high) for every token.

    Returns (loss 0-d, metrics). Metrics are detached 0-d float64 sums over this call's mask-1
    tokens: "n_tokens" (count), "clip_upper" (Ã>0, r>1+eps_high), "clip_lower" (Ã<0, r<1-eps_low),
    "clip_dual" (Ã<0, r>clip_c), "out_high" (r>1+eps_high) and "out_low" (r<1-eps_low), whatever Ã
    (CISPO's clipped IS weights); these count regions, the same for every variant. What the variant
    did there: "sg_kept" (upper-clipped tokens whose gradient was kept: sg_clip or cispo),
    "clip_low_kept" (lower-clipped tokens whose gradient was kept: sg_clip_low or cispo),
    "grad_dropped" (tokens whose gradient the clip or dual clip set to exactly 0; 0 under CISPO;
    the ±20 log-ratio clamp, not counted here, also leaves a token without gradient);
    "approx_kl" (k3 estimate of KL(π_old‖π_θ): r - 1 - log r), "ratio" (r), "kl_ref" (k3 to the
    reference, 0 without one), "entropy" (H, 0 without it); sum them over micro-batches/ranks and
    divide by the global count. "pg_loss", "kl_loss" and "entropy_loss" are this call's additive
    contributions to the loss (already aggregated).
    """
    shape = logp.shape
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)) + \
            ((("ref_logp", ref_logp),) if ref_logp is not None else ()) + \
            ((("entropy", entropy),) if entropy is not None else ()):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")
    for name, t in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        check_finite(name, t)
    n_valid = float(n_valid)
    if not n_valid > 0:
        raise ValueError(f"n_valid must be > 0 (global count of mask-1 tokens), got {n_valid}")
    agg = dict(n_valid=n_valid, loss_agg=loss_agg, n_seqs=n_seqs, max_len=max_len)
    valid = mask.bool()
    adv = advantages.float()

    log_ratio = torch.where(valid, (logp.float() - old_logp.float()).clamp(-20.0, 20.0), 0.0)
    r = torch.exp(log_ratio)
    r_sg = r.detach()                                                        # sg(.)
    if cispo:
        is_weight = r_sg.clamp(1.0 - eps_low, 1.0 + eps_high)               # sg(clip(r)): built from sg(r)
        j = is_weight * adv * logp.float()
    else:
        upper = (1.0 + eps_high) * r / r_sg if sg_clip else torch.full_like(r, 1.0 + eps_high)
        lower = (1.0 - eps_low) * r / r_sg if sg_clip_low else 1.0 - eps_low
        # clip(r, lower, upper) written with where so the gradient of an sg bound survives past it
        r_clip = torch.where(r_sg > 1.0 + eps_high, upper, torch.where(r_sg < 1.0 - eps_low, lower, r))
        surr, surr_clip = r * adv, r_clip * adv
        j = torch.where(surr <= surr_clip, surr, surr_clip)                  # min(r·Ã, clip(r)·Ã)
        dual = (adv < 0) & (j < clip_c * adv)
        j = torch.where(dual, clip_c * adv, j)                               # max(J, c·Ã) for Ã < 0
    pg_loss = aggregate(j, valid, scale=-1.0, **agg)
    loss = pg_loss

    kl_ref = torch.zeros((), dtype=torch.float32, device=logp.device)
    kl_loss = torch.zeros_like(kl_ref)
    if ref_logp is not None:
        check_finite("ref_logp", ref_logp)
        d = torch.where(valid, (ref_logp.float() - logp.float()).clamp(-20.0, 20.0), 0.0)
        k3 = (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)                     # KL(π_θ‖π_ref), k3 (low_var_kl)
        kl_ref = torch.where(valid, k3, 0.0).sum()
        if kl_coef:
            kl_loss = aggregate(k3, valid, scale=kl_coef, **agg)
            loss = loss + kl_loss

    entropy_sum = torch.zeros_like(kl_ref)
    entropy_loss = torch.zeros_like(kl_ref)
    if entropy is not None:
        check_finite("entropy (mask-1 tokens)", entropy[valid])
        entropy_sum = torch.where(valid, entropy.float(), 0.0).sum()
        if entropy_coeff:
            entropy_loss = aggregate(entropy.float(), valid, scale=-entropy_coeff, **agg)   # bonus: -c·H
            loss = loss + entropy_loss

    with torch.no_grad():
        m = valid.double()
        rd = r_sg.double()
        pos, neg = (adv > 0).double() * m, (adv < 0).double() * m
        clip_upper = (pos * (rd > 1.0 + eps_high)).sum()
        clip_lower = (neg * (rd < 1.0 - eps_low)).sum()
        clip_dual = (neg * (rd > clip_c)).sum()
        zero = torch.zeros_like(clip_upper)
        dropped = clip_dual + (zero if sg_clip else clip_upper) + (zero if sg_clip_low else clip_lower)
        metrics = {
            "n_tokens": m.sum(),
            "clip_upper": clip_upper,
            "clip_lower": clip_lower,
            "clip_dual": clip_dual,
            "out_high": (m * (rd > 1.0 + eps_high)).sum(),
            "out_low": (m * (rd < 1.0 - eps_low)).sum(),
            "sg_kept": clip_upper.clone() if sg_clip or cispo else zero.clone(),
            "clip_low_kept": clip_lower.clone() if sg_clip_low or cispo else zero.clone(),
            "grad_dropped": zero.clone() if cispo else dropped,
            "approx_kl": ((rd - 1.0 - log_ratio.detach().double()) * m).sum(),
            "ratio": (rd * m).sum(),
            "kl_ref": kl_ref.detach().double(),
            "entropy": entropy_sum.detach().double(),
            "pg_loss": pg_loss.detach().double(),
            "kl_loss": kl_loss.detach().double(),
            "entropy_loss": entropy_loss.detach().double(),
        }
    return loss, metrics
