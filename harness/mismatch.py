"""The generator–trainer mismatch (an extension, not in the paper: algorithm.md §4b): what every step logs of
ρ = π_old/π_gen over the loss tokens, and the opt-in correction that weights each token's objective by it.

The rollout's tokens come from a generator (vLLM, or the transformers model) while π_old is the trainer's; the two
differ by precision and kernels, or by weights after a broken weight sync. `mismatch_stats` sums what the logs need
(`MismatchSums`, named fields, added over micro-batches and ranks), `mismatch_metrics` turns the sums into means and
quantiles, and `Correction.weights` is verl's decoupled rollout correction (truncated importance weight and masks),
multiplying J_t in loss.policy_loss (its `weights`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from harness.cli import UserError

LOG_RATIO_EDGES = (-4.0, 4.0, 160)                 # the histogram of log ρ: 160 bins over [−4, 4], ends open
MASKS = ("token", "segment", "sequence")           # --mismatch_masks: the levels a band may mask at


@dataclass
class MismatchSums:
    """Sums over the mask-1 tokens whose generator log-prob is finite (float64, 0-d; hist: (n_bins,)): tokens, Σ k1,
    Σ k3, tokens with ρ ∉ [1/2, 2], sequences with such tokens, Σ over those sequences of their mean k1, their
    segments (policy spans between tool results), what the correction's bands dropped (tokens set to 0 by any band,
    tokens by the token band, segments by the segment band, trajectories by the sequence band), the rows whose
    generator log-probs had another length than the response (misfit: left out as having none), and the histogram
    of log ρ over LOG_RATIO_EDGES. Add them over micro-batches; `vector` / `from_vector` for a collective."""
    tokens: torch.Tensor
    k1: torch.Tensor
    k3: torch.Tensor
    outside: torch.Tensor
    sequences: torch.Tensor
    seq_mean_k1: torch.Tensor
    segments: torch.Tensor
    masked: torch.Tensor
    masked_tokens: torch.Tensor
    masked_segments: torch.Tensor
    masked_sequences: torch.Tensor
    misfit: torch.Tensor
    hist: torch.Tensor

    @classmethod
    def zeros(cls) -> MismatchSums:
        zero = torch.zeros((), dtype=torch.float64)
        return cls(*(zero,) * (len(fields(cls)) - 1), torch.zeros(LOG_RATIO_EDGES[2], dtype=torch.float64))

    def __add__(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums(*(getattr(self, f.name) + getattr(other, f.name).to(getattr(self, f.name).device)
                              for f in fields(self)))

    def vector(self) -> torch.Tensor:
        return torch.cat([getattr(self, f.name).reshape(-1).cpu() for f in fields(self)])

    @classmethod
    def from_vector(cls, vector: torch.Tensor) -> MismatchSums:
        n = len(fields(cls)) - 1
        return cls(*vector[:n], vector[n:])


def mismatch_stats(old_logp, gen_logp, mask, correction: Correction | None = None, misfit: int = 0) -> MismatchSums:
    """The sums of `MismatchSums` for one micro-batch, ρ = π_old/π_gen = exp(old − gen), k1 = log π_gen − log π_old
    (samples from the generator: KL(π_gen‖π_old) ≈ mean k1), k3 = ρ − 1 − log ρ. old_logp, gen_logp, mask: (B, T);
    correction: what its bands drop is counted; misfit: the micro-batch's rows of generator log-probs of another
    length (MicroBatch.misfit)."""
    valid = mask.bool() & torch.isfinite(gen_logp)
    log_rho = torch.where(valid, old_logp.double() - gen_logp.double(), 0.0).clamp(-20.0, 20.0)
    k1, k3 = -log_rho, torch.where(valid, log_rho.exp() - 1.0 - log_rho, 0.0)
    per_seq = valid.sum(-1)
    has = per_seq > 0
    seq_mean = torch.where(has, k1.sum(-1) / per_seq.clamp(min=1), 0.0)
    low, high, n_bins = LOG_RATIO_EDGES
    bins = ((log_rho - low) / (high - low) * n_bins).floor().clamp(0, n_bins - 1).long()
    hist = torch.zeros(n_bins, dtype=torch.float64, device=old_logp.device).index_add_(
        0, bins[valid], torch.ones_like(log_rho[valid]))
    outside = valid & ((log_rho < -math.log(2.0)) | (log_rho > math.log(2.0)))
    starts = valid & ~torch.nn.functional.pad(valid, (1, 0))[:, :-1]          # each segment's first token
    keeps = band_keeps(log_rho, valid, correction.bands if correction is not None else (None,) * len(MASKS))
    every = torch.ones_like(valid)
    for keep in keeps:
        every &= keep if keep is not None else True
    count = lambda t: t.sum().double()                                         # noqa: E731
    dropped = [None if keep is None else valid & ~keep for keep in keeps]
    zero = torch.zeros((), dtype=torch.float64, device=old_logp.device)
    return MismatchSums(count(valid), k1.sum(), k3.sum(), count(outside), count(has), seq_mean.sum(), count(starts),
                        count(valid & ~every),
                        zero if dropped[0] is None else count(dropped[0]),
                        zero if dropped[1] is None else count(starts & dropped[1]),
                        zero if dropped[2] is None else count(dropped[2].any(-1)),
                        zero + misfit, hist)


def mismatch_metrics(sums: MismatchSums, correction: Correction | None = None) -> dict:
    """The step's mismatch (sums over all ranks) as logged means: mean k1 and k3, the log-perplexity difference (per
    trajectory, averaged), the quantiles of ρ (from the histogram of log ρ) and the share of tokens with ρ outside
    [1/2, 2]; with the correction's masks on, the share of tokens they set to 0 and, per mask, the share of its units
    (tokens, segments, trajectories) it dropped; rows whose generator log-probs did not fit (when there were any).
    Empty when no token had a generator log-prob (a backend without them, vLLM at a temperature other than 1)."""
    n = float(sums.tokens)
    out = {"mismatch/misfit_rows": float(sums.misfit)} if float(sums.misfit) else {}
    if n == 0:
        return out
    low, high, n_bins = LOG_RATIO_EDGES
    cdf = sums.hist.double().cumsum(0) / sums.hist.double().sum()

    def quantile(q):                              # the upper edge of the bin where the cdf passes q
        return math.exp(low + (high - low) * (int((cdf < q).sum()) + 1) / n_bins)
    out.update({"mismatch/k1": float(sums.k1) / n, "mismatch/k3": float(sums.k3) / n,
                "mismatch/log_ppl_diff": float(sums.seq_mean_k1) / max(1.0, float(sums.sequences)),
                "mismatch/ratio_p01": quantile(0.01), "mismatch/ratio_p50": quantile(0.5),
                "mismatch/ratio_p99": quantile(0.99), "mismatch/out_2x": float(sums.outside) / n})
    if correction is not None and correction.masks:
        out["mismatch/masked"] = float(sums.masked) / n
        units = {"token": (sums.masked_tokens, n), "segment": (sums.masked_segments, float(sums.segments)),
                 "sequence": (sums.masked_sequences, float(sums.sequences))}
        for level in correction.masks:
            dropped, total = units[level]
            out[f"mismatch/masked_{level}s"] = float(dropped) / max(1.0, total)
    return out


def _run_ids(valid):
    """(B, T) long: 1, 2, ... for each run of consecutive mask-1 tokens of a row (its segments), 0 elsewhere."""
    starts = valid & ~torch.nn.functional.pad(valid, (1, 0))[:, :-1]
    return torch.where(valid, starts.long().cumsum(-1), 0)


def _mean_within(values, groups, valid):
    """Each valid entry's group mean of `values` (groups: (B, T) ids, 0 = none, per row), broadcast back."""
    n_groups = int(groups.max()) + 1 if groups.numel() else 1
    flat = (torch.arange(groups.shape[0], device=groups.device)[:, None] * n_groups + groups).flatten()
    w = valid.flatten().double()
    sums = torch.zeros(groups.shape[0] * n_groups, dtype=torch.float64, device=values.device)
    sums.index_add_(0, flat, values.flatten().double() * w)
    counts = torch.zeros_like(sums).index_add_(0, flat, w)
    return (sums / counts.clamp(min=1))[flat].view(groups.shape)


def band_keeps(log_rho, valid, bands) -> list:
    """Per level of MASKS (token, segment, sequence) with its band (low, high) given, the (B, T) bool of the tokens
    it keeps: each token's ρ, its segment's and its trajectory's geometric-mean ρ within the band (tokens outside
    `valid` are kept); None for a level whose band is None."""
    levels = (lambda: log_rho, lambda: _mean_within(log_rho, _run_ids(valid), valid),
              lambda: _mean_within(log_rho, valid.long(), valid))
    return [None if band is None else ~valid | ((level() >= math.log(band[0])) & (level() <= math.log(band[1])))
            for band, level in zip(bands, levels)]


def rollout_correction(old_logp, gen_logp, mask, tis_cap=0.0, token_band=None, segment_band=None,
                       sequence_band=None):
    """Eq. (the decoupled correction of verl's rollout correction; algorithm.md §4b), ρ_t = π_old/π_gen:
         w_t = sg(min(ρ_t, tis_cap))                                  (tis_cap > 0: truncated importance weight)
             · [ρ_t ∈ token_band]                                     (token mask, a 0/1 mask; IcePop with tis_cap)
             · [exp(mean_{t' ∈ segment} log ρ_t') ∈ segment_band]     (a policy span between tool results)
             · [exp(mean_{t' ∈ trajectory} log ρ_t') ∈ sequence_band]  (geometric mean over the trajectory)
    multiplying the surrogate J_t, whose ratio stays π_θ/π_old. Bands are (low, high) or None (off); tokens with no
    finite generator log-prob get w = 1. The token mask alone is 0/1; IcePop (verl's) also weights the tokens it
    keeps by ρ, which is the token mask with tis_cap ≥ the band's upper end. old_logp, gen_logp, mask: (B, T).
    Returns (w (B, T) detached, masked (B, T) bool: the tokens a band set to 0)."""
    valid = mask.bool() & torch.isfinite(gen_logp)
    log_rho = torch.where(valid, old_logp.detach().double() - gen_logp.double(), 0.0).clamp(-20.0, 20.0)
    w = torch.where(valid & (tis_cap > 0), log_rho.exp().clamp(max=tis_cap if tis_cap > 0 else 1.0), 1.0)
    keep = torch.ones_like(valid)
    for level_keep in band_keeps(log_rho, valid, (token_band, segment_band, sequence_band)):
        if level_keep is not None:
            keep &= level_keep
    return (w * keep).float().detach(), valid & ~keep                       # sg(.)


@dataclass(frozen=True)
class Correction:
    """The correction's settings, one object: --tis_cap (0 = off), --mismatch_masks (some of MASKS) and
    --mismatch_band '[a, b]'. `on` is the one test of whether any part is asked for."""
    tis_cap: float = 0.0
    masks: tuple[str, ...] = ()
    band: tuple[float, float] = (0.5, 2.0)

    @property
    def on(self) -> bool:
        return bool(self.tis_cap or self.masks)

    def weights(self, old_logp, gen_logp, mask) -> torch.Tensor | None:
        """`rollout_correction`'s weights w (B, T) for these settings, or None when the correction is off. A
        UserError when it is on and no mask-1 token has a generator log-prob (the backend gave none)."""
        if not self.on:
            return None
        if gen_logp is None or not torch.isfinite(gen_logp[mask.bool()]).any():
            raise UserError("the mismatch correction needs the generator's log-probs, which this generator did not "
                             "give (vLLM gives them at --temperature 1 only)")
        return rollout_correction(old_logp, gen_logp, mask, self.tis_cap, *self.bands)[0]

    @property
    def bands(self) -> tuple:
        """Per level of MASKS, the band when that mask is on, else None."""
        return tuple(self.band if level in self.masks else None for level in MASKS)
