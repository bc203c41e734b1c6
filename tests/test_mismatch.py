"""The generator–trainer mismatch and its opt-in correction (harness/mismatch.py; algorithm.md §4b): the sums and
metrics by hand, the correction's weights and gradient, and how the training flags reach it."""
import math

import pytest
import torch

import loss as L
from harness import cli, config, mismatch as M, settings


def test_mismatch_stats_by_hand():
    """ρ = π_old/π_gen = e^(old − gen): tokens (ρ = e^0.1, e^−1, e^2) and a mask-0 token and a nan one left out:
    Σ k1 = −(0.1 − 1 + 2), Σ k3 = Σ (ρ − 1 − log ρ), outside [1/2, 2]: e^−1 and e^2; per sequence mean k1."""
    old = torch.tensor([[0.1, -1.0, 0.0], [2.0, 5.0, 0.0]])
    gen = torch.tensor([[0.0, 0.0, float("nan")], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    s = M.mismatch_stats(old, gen, mask)
    rho = [math.exp(0.1), math.exp(-1.0), math.exp(2.0)]
    assert s.tokens.item() == 3 and s.k1.item() == pytest.approx(-(0.1 - 1.0 + 2.0))
    assert s.k3.item() == pytest.approx(sum(r - 1 - math.log(r) for r in rho))
    assert s.outside.item() == 2 and s.sequences.item() == 2
    assert s.seq_mean_k1.item() == pytest.approx(-(0.1 - 1.0) / 2 - 2.0)    # mean k1 of each sequence, summed
    assert s.hist.sum().item() == 3 and s.hist[int((2.0 + 4) / 8 * 160)].item() == 1     # log ρ = 2 in its bin
    twice = M.MismatchSums.from_vector((s + s).vector())                    # a collective's round trip
    assert twice.tokens.item() == 6 and torch.equal(twice.hist, 2 * s.hist)
    metrics = M.mismatch_metrics(twice)
    assert metrics["mismatch/k1"] == pytest.approx(s.k1.item() / 3) and metrics["mismatch/out_2x"] == 2 / 3
    assert M.mismatch_metrics(M.MismatchSums.zeros()) == {}                 # no generator log-probs: no metrics


def test_rollout_correction_weights_by_hand():
    """log ρ per token (row 0: segments {0, 1} and {3}, token 2 a tool result; row 1: one segment, token 3 without a
    generator log-prob): TIS caps ρ at C; the token band drops ρ outside [1/2, 2]; the segment band the segments
    whose geometric mean is outside (row 0's first: e^0.75 = 2.12); the sequence band whole trajectories (row 1:
    e^(1.7/3) = 1.76 > 1.7, row 0: e^(1.4/3) = 1.59). nan and mask-0 tokens keep weight 1."""
    log_rho = torch.tensor([[0.0, 1.5, 0.0, -0.1], [0.2, 0.3, 1.2, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    old, gen = torch.zeros(2, 4), -log_rho
    w, _ = M.rollout_correction(old, gen, mask, tis_cap=2.0)
    expected = torch.tensor([[1.0, 2.0, 1.0, math.exp(-0.1)], [math.exp(0.2), math.exp(0.3), 2.0, 1.0]])
    torch.testing.assert_close(w, expected)
    w, dropped = M.rollout_correction(old, gen, mask, token_band=(0.5, 2.0))
    assert w.tolist() == [[1, 0, 1, 1], [1, 1, 0, 1]] and dropped.sum().item() == 2   # e^1.5 and e^1.2 > 2
    w, _ = M.rollout_correction(old, gen, mask, segment_band=(0.5, 2.0))
    assert w.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    w, _ = M.rollout_correction(old, gen, mask, sequence_band=(0.5, 1.7))
    assert w.tolist() == [[1, 1, 1, 1], [0, 0, 0, 1]]
    assert not w.requires_grad


def test_rollout_correction_gradient_is_weight_times_the_surrogates():
    """Decoupled: the ratio stays π_θ/π_old, the weight multiplies J and carries no gradient. With r = 1 (one
    optimiser step per rollout) ∂loss/∂log π = −w·Ã/N at every token, and 0 where a band dropped it."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old, adv, mask = logp.detach().clone(), torch.tensor([[1.0, -2.0, 0.5]]), torch.ones(1, 3)
    gen = old - torch.tensor([[0.3, 1.2, -0.2]])                        # ρ = e^0.3, e^1.2, e^−0.2
    w, _ = M.rollout_correction(old, gen, mask, tis_cap=2.0, token_band=(0.5, 3.0))
    loss, _ = L.policy_loss(logp, old, adv, mask, 3, weights=w)
    loss.backward()
    rho = torch.tensor([[math.exp(0.3), 2.0, math.exp(-0.2)]])           # e^1.2 = 3.3 capped at 2, then dropped
    expected_w = rho * torch.tensor([[1.0, 0.0, 1.0]])
    torch.testing.assert_close(w, expected_w)
    torch.testing.assert_close(logp.grad, -expected_w * adv / 3)
    plain, _ = L.policy_loss(logp.detach().requires_grad_(), old, adv, mask, 3)
    assert plain.item() == pytest.approx(-(adv.sum() / 3).item())       # without weights: the plain objective


def test_the_correction_flags_reach_the_weights():
    """settings.correction reads each flag: all off gives no weights (the default run's loss is unchanged); each on
    gives rollout_correction's weights with its band; no generator log-probs is a UserError (one line)."""
    old, gen, mask = torch.zeros(1, 3), torch.tensor([[0.0, -1.0, 0.5]]), torch.ones(1, 3)   # ρ = 1, e, e^−0.5
    weights = lambda **flags: settings.correction(config.Config(**flags)).weights(old, gen, mask)  # noqa: E731
    assert weights() is None
    assert weights(tis_cap=2.0)[0].tolist() == pytest.approx([1.0, 2.0, math.exp(-0.5)])
    assert weights(mismatch_masks=["token"]).tolist() == [[1.0, 0.0, 1.0]]
    assert weights(mismatch_masks=["sequence"], mismatch_band=[0.5, 1.2]).tolist() == [[1.0, 1.0, 1.0]]  # e^(0.5/3)
    assert weights(mismatch_masks=["segment"], mismatch_band=[0.5, 1.1]).tolist() == [[0.0, 0.0, 0.0]]
    with pytest.raises(cli.UserError, match="needs the generator's log-probs"):
        settings.correction(config.Config(tis_cap=2.0)).weights(old, torch.full((1, 3), float("nan")), mask)


def test_the_names_that_left_loss_are_harness_mismatchs():
    """loss.mismatch_stats, loss.rollout_correction and loss.LOG_RATIO_EDGES moved to harness/mismatch.py without an
    alias (loss.py copies alone: it imports nothing of the harness); docs/reference.md's renames say so."""
    for name in ("mismatch_stats", "rollout_correction", "LOG_RATIO_EDGES"):
        assert hasattr(M, name)
        with pytest.raises(AttributeError):
            getattr(L, name)


def test_what_each_mask_dropped_is_counted():
    """The example above with all three masks on, band [1/2, 2]: the token band drops 2 of the 6 tokens with a
    generator log-prob (e^1.5, e^1.2), the segment band 1 of the 3 segments (row 0's first, e^0.75), the sequence band
    none of the 2 trajectories; together they set 3 tokens to 0. Only the masks that are on are logged."""
    log_rho = torch.tensor([[0.0, 1.5, 0.0, -0.1], [0.2, 0.3, 1.2, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    old, gen = torch.zeros(2, 4), -log_rho
    every = M.Correction(masks=("token", "segment", "sequence"))
    s = M.mismatch_stats(old, gen, mask, every)
    assert (s.tokens.item(), s.segments.item(), s.sequences.item()) == (6, 3, 2)
    assert (s.masked.item(), s.masked_tokens.item(), s.masked_segments.item(), s.masked_sequences.item()) == \
        (3, 2, 1, 0)
    _, dropped = M.rollout_correction(old, gen, mask, 0.0, *every.bands)
    assert dropped.sum().item() == s.masked.item()
    metrics = M.mismatch_metrics(M.MismatchSums.from_vector(s.vector()), every)
    assert (metrics["mismatch/masked"], metrics["mismatch/masked_tokens"], metrics["mismatch/masked_segments"],
            metrics["mismatch/masked_sequences"]) == pytest.approx((0.5, 2 / 6, 1 / 3, 0.0))
    only_tokens = M.mismatch_metrics(M.mismatch_stats(old, gen, mask, M.Correction(masks=("token",))),
                                     M.Correction(masks=("token",)))
    assert {k for k in only_tokens if "masked" in k} == {"mismatch/masked", "mismatch/masked_tokens"}
    assert not any("masked" in k for k in M.mismatch_metrics(M.mismatch_stats(old, gen, mask)))   # masks off


def test_the_token_mask_with_a_cap_at_the_band_is_icepop():
    """The token mask alone is 0/1; IcePop (verl's) weights the tokens it keeps by ρ and drops the others: that is
    --mismatch_masks '[token]' with --tis_cap at the band's upper end."""
    old, mask = torch.zeros(1, 5), torch.ones(1, 5)
    gen = -torch.tensor([[0.0, 0.6, -0.6, 0.9, -0.9]])                     # ρ = 1, e^±0.6 (in), e^±0.9 (out)
    rho = torch.exp(old - gen)
    icepop = torch.where((rho >= 0.5) & (rho <= 2.0), rho, 0.0)
    plain = M.Correction(masks=("token",)).weights(old, gen, mask)
    assert plain.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    torch.testing.assert_close(M.Correction(tis_cap=2.0, masks=("token",)).weights(old, gen, mask), icepop)


def test_generator_logprobs_of_another_length_are_counted_and_warned():
    """A trajectory whose generator log-probs do not fit its response (a generator bug) becomes a row without any
    (nan): it is counted in the step's metrics, and the step's log says so in one line."""
    from harness.run import policy, runlog
    batch = policy.tensorize([([5, 6], [7, 8, 9], [1, 1, 1]), ([5], [7, 8], [1, 1])], 0, "cpu",
                             gen_logp=[[-1.0, -1.0, -1.0], [-1.0]])           # the second is one short
    assert batch.misfit == 1 and torch.isnan(batch.gen_logp[1]).all()
    sums = M.mismatch_stats(torch.zeros_like(batch.gen_logp), batch.gen_logp, batch.mask, misfit=batch.misfit)
    metrics = M.mismatch_metrics(sums)
    assert metrics["mismatch/misfit_rows"] == 1 and sums.tokens.item() == 3
    warning = runlog.MismatchWatch().check(4, metrics)
    assert warning.startswith("warning: step 4: 1 trajectories' generator log-probs had another length")
    assert "mismatch/misfit_rows" not in M.mismatch_metrics(M.mismatch_stats(torch.zeros(1, 2), torch.zeros(1, 2),
                                                                             torch.ones(1, 2)))
