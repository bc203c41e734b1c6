"""loss.py: entropy / log-prob definitions, the chunked path, and the AEPO loss's values and gradients; the baselines'
switches (GPPO, CISPO, the entropy bonus, verl's loss aggregations) by hand, gradient weights re-derived per case."""
import math

import pytest
import torch

import loss as L

# ---------------------------------------------------------------------------------------------
# Entropy and log-probs


def test_entropy_uniform_is_log_v_and_one_hot_is_zero():
    V = 1000
    assert torch.allclose(L.token_entropy(torch.zeros(3, V)), torch.full((3,), math.log(V)))
    assert torch.allclose(L.token_entropy(torch.randn(2, V) * 1e-9), torch.full((2,), math.log(V)))
    peaked = torch.full((2, V), -1e4)
    peaked[:, 7] = 1e4
    assert torch.allclose(L.token_entropy(peaked), torch.zeros(2), atol=1e-6)


def test_entropy_and_logprobs_by_hand_with_temperature():
    z = torch.tensor([[0.0, math.log(3.0)]])           # p = (1/4, 3/4) at T = 1
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(L.token_entropy(z), torch.tensor([h]))
    assert torch.allclose(L.token_logprobs(z, torch.tensor([1])), torch.tensor([math.log(0.75)]))
    # T = 2: p ∝ (1, sqrt 3)
    q = torch.tensor([1.0, math.sqrt(3.0)]) / (1 + math.sqrt(3.0))
    assert torch.allclose(L.token_entropy(z, temperature=2.0), -(q * q.log()).sum().reshape(1))
    assert torch.allclose(L.token_logprobs(z, torch.tensor([0]), temperature=2.0), q[0].log().reshape(1))
    assert L.token_entropy(z.bfloat16()).dtype == torch.float32


def _direct(hidden, weight, ids, temperature):
    logits = hidden.float() @ weight.float().T
    return L.token_logprobs(logits, ids, temperature), L.token_entropy(logits, temperature)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 5), (1.3, 64)])
def test_chunked_equals_direct_values_and_gradients(temperature, chunk):
    torch.manual_seed(0)
    N, D, V = 23, 16, 50                             # chunk 7 and 5 do not divide 23
    h = torch.randn(N, D, dtype=torch.float64)
    w = torch.randn(V, D, dtype=torch.float64)
    ids = torch.randint(0, V, (N,))
    g1, g2 = torch.randn(N), torch.randn(N)
    results = []
    for fn in (_direct, lambda a, b, c, t: L.logprobs_and_entropy(a, b, c, t, chunk_size=chunk)):
        hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
        logp, ent = fn(hh, ww, ids, temperature)
        ((logp * g1).sum() + (ent * g2).sum()).backward()
        results.append((logp.detach(), ent.detach(), hh.grad, ww.grad))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    # gradient through logp only (the trainer's use: entropy detached)
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    logp, _ = L.logprobs_and_entropy(hh, ww, ids, temperature, chunk_size=chunk)
    (logp * g1).sum().backward()
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    (_direct(hr, wr, ids, temperature)[0] * g1).sum().backward()
    assert torch.allclose(hh.grad, hr.grad, atol=1e-5) and torch.allclose(ww.grad, wr.grad, atol=1e-5)
    # gradient through the entropy only
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    (L.logprobs_and_entropy(hh, ww, ids, temperature, chunk_size=chunk)[1] * g2).sum().backward()
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    (_direct(hr, wr, ids, temperature)[1] * g2).sum().backward()
    assert torch.allclose(hh.grad, hr.grad, atol=1e-5) and torch.allclose(ww.grad, wr.grad, atol=1e-5)


def test_chunked_uniform_and_peaked():
    V = 300
    logp, ent = L.logprobs_and_entropy(torch.randn(5, 4), torch.zeros(V, 4), torch.arange(5), chunk_size=2)
    assert torch.allclose(ent, torch.full((5,), math.log(V))) and torch.allclose(logp, torch.full((5,), -math.log(V)))
    w = torch.zeros(V, 4)
    w[3, 0] = 1e4                                      # token 3 takes all the mass when h[:, 0] = 1
    logp, ent = L.logprobs_and_entropy(torch.tensor([[1.0, 0, 0, 0]] * 3), w, torch.tensor([3, 3, 0]), chunk_size=2)
    assert torch.allclose(ent, torch.zeros(3), atol=1e-6) and torch.allclose(logp[:2], torch.zeros(2))


def test_chunked_gradcheck_float64():
    torch.manual_seed(1)
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 9, (5,))
    # the function computes in float32, so compare against finite differences loosely
    fn = lambda a, b: L.logprobs_and_entropy(a.float(), b.float(), ids, 0.9, chunk_size=2)
    logp, ent = fn(h, w)
    (logp.sum() + 0.5 * ent.sum()).backward()
    eps = 1e-3
    for t in (h, w):
        num = torch.zeros_like(t)
        for i in range(t.numel()):
            d = torch.zeros_like(t).view(-1)
            d[i] = eps
            d = d.view_as(t)
            with torch.no_grad():
                args_p = (h + d, w) if t is h else (h, w + d)
                args_m = (h - d, w) if t is h else (h, w - d)
                fp = sum(x.sum() * c for x, c in zip(fn(*args_p), (1.0, 0.5)))
                fm = sum(x.sum() * c for x, c in zip(fn(*args_m), (1.0, 0.5)))
            num.view(-1)[i] = (fp - fm) / (2 * eps)
        assert torch.allclose(t.grad, num, atol=2e-3)


def test_chunked_bf16_inputs_give_float32_outputs_and_input_dtype_grads():
    torch.manual_seed(2)
    h = torch.randn(6, 8).bfloat16().requires_grad_()
    w = torch.randn(11, 8).bfloat16().requires_grad_()
    logp, ent = L.logprobs_and_entropy(h, w, torch.randint(0, 11, (6,)), chunk_size=4)
    assert logp.dtype == ent.dtype == torch.float32
    logp.sum().backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16


def test_chunked_frozen_weight_and_bad_shapes():
    h = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(5, 3)
    L.logprobs_and_entropy(h, w, torch.zeros(4, dtype=torch.long))[0].sum().backward()
    assert h.grad is not None and w.grad is None
    with pytest.raises(ValueError, match="weight"):
        L.logprobs_and_entropy(h, torch.randn(5, 4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="ids"):
        L.logprobs_and_entropy(h, w, torch.zeros(3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Policy loss


VARIANT_KW = {"ppo": dict(sg_clip=False), "aepo": {}, "gppo": dict(surrogate="gppo"), "cispo": dict(surrogate="cispo")}


def _grad_weight(r, a, variant="aepo", **kw):
    """F from ∂loss/∂logp = -F·A/n_valid for one token with ratio r and advantage a (variant: a name of VARIANT_KW; kw:
    the other LossSettings)."""
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(r), requires_grad=True)
    loss, _ = L.policy_loss(logp, old, torch.full((1, 1), a), torch.ones(1, 1), 1,
                            L.LossSettings(**VARIANT_KW[variant], **kw))
    loss.backward()
    return (-logp.grad / a).item()


@pytest.mark.parametrize("r,a,f_ppo,f_aepo", [
    (1.5, 1.0, 0.0, 1.2),      # A > 0, r > 1 + eps_high
    (0.5, -1.0, 0.0, 0.0),     # A < 0, r < 1 - eps_low
    (4.0, -1.0, 0.0, 0.0),     # A < 0, r > clip_c (dual clip)
    (1.1, 1.0, 1.1, 1.1),      # inside the trust region
    (0.5, 2.0, 0.5, 0.5),      # A > 0, r < 1 - eps_low: min picks r·A
    (1.5, -0.5, 1.5, 1.5),     # A < 0, 1 + eps_high < r < clip_c: min picks r·A
])
def test_gradient_table(r, a, f_ppo, f_aepo):
    assert _grad_weight(r, a, "ppo") == pytest.approx(f_ppo, abs=1e-6)
    assert _grad_weight(r, a, "aepo") == pytest.approx(f_aepo, abs=1e-6)


def test_gradient_table_other_eps():
    assert _grad_weight(2.0, 1.0, "aepo", eps_high=0.28) == pytest.approx(1.28, abs=1e-6)
    assert _grad_weight(1.25, 1.0, "aepo", eps_high=0.28) == pytest.approx(1.25, abs=1e-6)


def test_loss_values_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.5, 4.0, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    # J = 1.2·1, 0.8·(-1), 3·(-1), 1·2  -> Σ J = 1.2 - 0.8 - 3 + 2 = -0.6; n_valid = 6
    for sg in (True, False):
        loss, m = L.policy_loss(logp, torch.zeros(1, 4), adv, mask, 6, L.LossSettings(sg_clip=sg))
        assert loss.item() == pytest.approx(0.6 / 6, abs=1e-6)
    assert m["n_tokens"].item() == 4 and m["clip_hi"].item() == 1
    assert m["clip_lo"].item() == 1 and m["clip_dual"].item() == 1 and m["preserved"].item() == 0
    assert m["ratio"].item() == pytest.approx(7.0)
    k3 = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 4.0, 1.0))
    assert m["approx_kl"].item() == pytest.approx(k3, rel=1e-6)
    _, m = L.policy_loss(logp, torch.zeros(1, 4), adv, mask, 6, L.LossSettings(surrogate="aepo"))
    assert m["preserved"].item() == 1
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_masked_tokens_get_exactly_zero_gradient():
    torch.manual_seed(3)
    logp = (torch.randn(3, 8) * 0.5).requires_grad_()
    old = torch.randn(3, 8) * 0.5
    old[0, 0] = 500.0                                     # garbage at a padding position
    mask = (torch.rand(3, 8) > 0.4).float()
    mask[0, 0] = 0
    loss, m = L.policy_loss(logp, old, torch.randn(3, 8), mask, mask.sum())
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(logp.grad[mask == 0] == 0)
    assert m["n_tokens"].item() == mask.sum().item()


def test_ratio_one_is_plain_policy_gradient():
    torch.manual_seed(4)
    logp = torch.randn(2, 6).requires_grad_()
    adv, mask = torch.randn(2, 6), (torch.rand(2, 6) > 0.3).float()
    for sg in (True, False):
        logp.grad = None
        loss, _ = L.policy_loss(logp, logp.detach(), adv, mask, 10, L.LossSettings(sg_clip=sg))
        loss.backward()
        assert loss.item() == pytest.approx(-(adv * mask).sum().item() / 10, abs=1e-6)
        assert torch.allclose(logp.grad, -adv * mask / 10, atol=1e-7)


def _textbook_ppo(logp, old, adv, mask, n_valid, eps=0.2, c=3.0):
    ratio = torch.exp(logp - old)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.min(-adv * c, clip1)
    pg = torch.where(adv < 0, clip2, clip1)
    return (pg * mask).sum() / n_valid


def test_sg_clip_off_equals_textbook_ppo():
    torch.manual_seed(5)
    logp = (torch.randn(4, 32) * 0.6).requires_grad_()
    old, adv = torch.randn(4, 32) * 0.6, torch.randn(4, 32)
    mask = (torch.rand(4, 32) > 0.2).float()
    loss, _ = L.policy_loss(logp, old, adv, mask, 77.0, L.LossSettings(sg_clip=False))
    (g,) = torch.autograd.grad(loss, logp)
    ref = _textbook_ppo(logp, old, adv, mask, 77.0)
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert torch.allclose(loss, ref, atol=1e-6) and torch.allclose(g, g_ref, atol=1e-7)
    # sg_clip on: same value, gradient differs only on upper-clipped positive-advantage tokens
    loss2, _ = L.policy_loss(logp, old, adv, mask, 77.0, L.LossSettings(surrogate="aepo"))
    (g2,) = torch.autograd.grad(loss2, logp)
    up = (adv > 0) & (torch.exp(logp - old) > 1.2) & (mask > 0)
    assert up.any() and torch.allclose(loss2, ref, atol=1e-6)
    assert torch.allclose(g2[~up], g_ref[~up], atol=1e-7)
    assert torch.allclose(g2[up], -1.2 * adv[up] / 77.0, atol=1e-7)


def test_micro_batches_give_the_same_gradient():
    torch.manual_seed(6)
    logp = (torch.randn(8, 20) * 0.5).requires_grad_()
    old, adv = torch.randn(8, 20) * 0.5, torch.randn(8, 20)
    mask = (torch.rand(8, 20) > 0.3).float()
    ref_logp = torch.randn(8, 20) * 0.5
    n_valid = mask.sum()
    full, _ = L.policy_loss(logp, old, adv, mask, n_valid, L.LossSettings(kl_coef=0.1), ref_logp=ref_logp)
    (g_full,) = torch.autograd.grad(full, logp)
    acc, total = torch.zeros_like(logp), 0.0
    for sl in (slice(0, 3), slice(3, 4), slice(4, 8)):    # uneven micro-batches
        part = logp.detach()[sl].clone().requires_grad_()
        l, _ = L.policy_loss(part, old[sl], adv[sl], mask[sl], n_valid,
                             L.LossSettings(kl_coef=0.1), ref_logp=ref_logp[sl])
        l.backward()
        acc[sl] = part.grad
        total += l.item()
    assert torch.allclose(acc, g_full, atol=1e-6) and total == pytest.approx(full.item(), abs=1e-6)


def test_kl_to_reference_k3_value_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.zeros(1, 3)                               # isolate the KL term
    loss, m = L.policy_loss(logp, logp.detach(), adv, mask, 4, L.LossSettings(kl_coef=0.5), ref_logp=ref)
    d = (ref - logp.detach())[0, :2]
    k3 = (d.exp() - d - 1).sum()
    assert m["kl_ref"].item() == pytest.approx(k3.item(), rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3.item() / 4, rel=1e-6)
    loss.backward()
    expected = 0.5 * (1 - (ref - logp.detach()).exp()) * mask / 4   # d k3/d logp = 1 - e^(ref - logp)
    assert torch.allclose(logp.grad, expected, atol=1e-7)
    # kl_coef = 0: metric still reported, loss unchanged
    loss0, m0 = L.policy_loss(logp, logp.detach(), adv, mask, 4, ref_logp=ref)
    assert loss0.item() == 0 and m0["kl_ref"].item() == pytest.approx(k3.item(), rel=1e-6)


def test_kl_k3_is_clamped_at_10_like_the_official_low_var_kl():
    """A token whose reference is far more likely (ref - logp = 5: k3 = e^5 - 6 = 142) counts 10, with no gradient;
    its neighbour below the clamp keeps value and gradient."""
    logp = torch.tensor([[-6.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    mask = torch.ones(1, 2)
    loss, m = L.policy_loss(logp, logp.detach(), torch.zeros(1, 2), mask, 2, L.LossSettings(kl_coef=1.0), ref_logp=ref)
    small = math.exp(-0.5) + 0.5 - 1
    assert m["kl_ref"].item() == pytest.approx(10.0 + small, rel=1e-6)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx((1 - math.exp(-0.5)) / 2, rel=1e-6)


@pytest.mark.parametrize("name", ["logp", "old_logp", "advantages", "mask", "ref_logp"])
def test_non_finite_inputs_raise_naming_tensor_and_count(name):
    args = {k: torch.zeros(2, 3) for k in ("logp", "old_logp", "advantages", "ref_logp")}
    args["mask"] = torch.ones(2, 3)
    args[name][0, 0], args[name][1, 2] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=rf"^{name}: 2 of 6 entries are non-finite"):
        L.policy_loss(args["logp"], args["old_logp"], args["advantages"], args["mask"], 6,
                      L.LossSettings(kl_coef=0.1), ref_logp=args["ref_logp"])


def test_bad_n_valid_and_shapes_raise():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="n_valid"):
        L.policy_loss(z, z, z, z, 0)
    with pytest.raises(ValueError, match="advantages"):
        L.policy_loss(z, z, torch.zeros(3), z, 1)                       # (T,) is not one per sequence
    with pytest.raises(TypeError, match="LossSettings"):
        L.policy_loss(z, z, z, z, 1, 0.2)                               # the old positional eps_low


def test_log_ratio_and_k3_by_hand():
    """log r = logp − old_logp clamped to ±20 at mask-1 tokens, 0 (no gradient) elsewhere; k3 = e^d − d − 1 with
    d = ref − logp, so ∂k3/∂logp = 1 − e^d, 0 at mask-0 tokens."""
    logp = torch.tensor([[-1.0, -2.0, -30.0, -0.5]], requires_grad=True)
    old, ref = torch.tensor([[-1.5, -2.0, 0.0, 9.0]]), torch.tensor([[-0.5, -3.0, -1.0, 9.0]])
    valid = torch.tensor([[True, True, True, False]])
    log_r = L.log_ratio(logp, old, valid)
    assert log_r.tolist() == [[0.5, 0.0, -20.0, 0.0]] and log_r.dtype == torch.float32
    (g,) = torch.autograd.grad(log_r.sum(), logp)
    assert g.tolist() == [[1.0, 1.0, 0.0, 0.0]]                         # clamped and masked: no gradient
    kl = L.k3(logp, ref, valid)
    d = torch.tensor([0.5, -1.0])
    assert torch.allclose(kl[0, :2], d.exp() - d - 1) and kl[0, 2] == 10.0 and kl[0, 3] == 0.0   # clamp to 10
    (g,) = torch.autograd.grad(kl[:, :2].sum() + kl[:, 3].sum(), logp)
    assert torch.allclose(g[0, :2], 1 - d.exp()) and g[0, 3] == 0.0


def test_sg_clip_is_a_boolean_setting_of_both_sg_surrogates():
    """sg_clip off: AEPO is PPO's clip and GPPO's upper bound is PPO's (no gradient past 1+ε_h); a non-boolean
    sg_clip (a YAML string) is refused, not read as true."""
    assert _grad_weight(1.5, 1.0, "aepo", sg_clip=False) == 0.0
    assert _grad_weight(1.5, 1.0, "gppo", sg_clip=False) == 0.0
    assert _grad_weight(0.5, -1.0, "gppo", sg_clip=False) == pytest.approx(0.8, abs=1e-6)   # the lower bound stays
    assert _grad_weight(1.5, 1.0, "cispo", sg_clip=False) == pytest.approx(1.2, abs=1e-6)   # CISPO has no sg bound
    with pytest.raises(TypeError, match="sg_clip is a switch"):
        L.LossSettings(sg_clip="false")
    with pytest.raises(ValueError, match="surrogate must be one of aepo, gppo, cispo"):
        L.LossSettings("grpo")
    with pytest.raises(TypeError, match="sg_clipp"):
        L.LossSettings(sg_clipp=False)


def test_an_old_keyword_or_an_unknown_one_is_a_type_error_naming_it():
    """policy_loss's keywords before LossSettings are gone (docs/reference.md: the renames), like any unknown one;
    LossSettings(surrogate="ppo") is a ValueError (sg_clip=False is PPO's clip)."""
    z = torch.zeros(1, 2)
    for keyword in ("sg_clipp", "sg_clip", "cispo", "entropy_coeff"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
            L.policy_loss(z, z, z, torch.ones(1, 2), 2, **{keyword: 1})
    with pytest.raises(ValueError, match="surrogate must be one of aepo, gppo, cispo; got 'ppo'"):
        L.LossSettings("ppo")


def test_one_advantage_per_sequence_is_broadcast_over_its_tokens():
    """TRL passes (B,) advantages: the loss, metrics and gradient equal those of the (B, T) broadcast."""
    torch.manual_seed(3)
    logp = (torch.randn(3, 6) * 0.4).requires_grad_()
    old, adv, mask = torch.randn(3, 6) * 0.4, torch.randn(3), (torch.rand(3, 6) > 0.3).float()
    per_seq, m1 = L.policy_loss(logp, old, adv, mask, mask.sum())
    (g1,) = torch.autograd.grad(per_seq, logp)
    per_token, m2 = L.policy_loss(logp, old, adv[:, None].expand(3, 6), mask, mask.sum())
    (g2,) = torch.autograd.grad(per_token, logp)
    assert per_seq.item() == per_token.item() and torch.equal(g1, g2) and g1.abs().sum() > 0
    assert all(m1[key].item() == m2[key].item() for key in m1)


def test_chunked_path_is_float32_inside_autocast():
    """Under bf16 autocast (forward and backward inside the context) the chunked path still computes
    in float32: same values and gradients as without autocast."""
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    ids = torch.randint(0, 50, (7,))
    logp, ent = L.logprobs_and_entropy(hidden, weight, ids, chunk_size=3)
    gh, gw = torch.autograd.grad((logp.sum() + ent.sum()), (hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp2, ent2 = L.logprobs_and_entropy(hidden, weight, ids, chunk_size=3)
        gh2, gw2 = torch.autograd.grad((logp2.sum() + ent2.sum()), (hidden, weight))
    assert logp2.dtype == torch.float32
    torch.testing.assert_close(logp2, logp)
    torch.testing.assert_close(ent2, ent)
    torch.testing.assert_close(gh2, gh)
    torch.testing.assert_close(gw2, gw)


def test_log_ratio_is_clamped_to_20():
    """D19: log r is clamped to [-20, 20] before exp. A token 100 nats more likely than under π_old would
    otherwise give r = inf and a nan loss: clamped, its ratio is e^20, a positive-advantage token counts 1 + ε_h
    (A = 1) and a negative one the dual clip c·A (A = −1), with no gradient past the clamp; a log-ratio of 30
    reports r = e^20."""
    logp = torch.tensor([[100.0, 100.0, 30.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, m = L.policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 3)
    assert loss.item() == pytest.approx(-(1.2 - 3.0 + 1.2) / 3, abs=1e-6)
    assert m["ratio"].item() == pytest.approx(3 * math.exp(20), rel=1e-6)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3))


def test_pg_loss_metric_excludes_the_kl_term():
    """The metrics split the loss: "pg_loss" is the clipped surrogate alone and "kl_loss" the KL penalty, summing to
    the loss. By hand (r = 1): pg = −(1 − 0.5)/4 = −0.125; k3 at ref − logp = −0.5 and 1: e^−0.5 − 0.5 and e − 2,
    kl = 0.5·(0.10653 + 0.71828)/4 = 0.10310."""
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    loss, m = L.policy_loss(logp, logp, torch.tensor([[1.0, -0.5]]), torch.ones(1, 2), 4,
                            L.LossSettings(kl_coef=0.5), ref_logp=ref)
    kl = 0.5 * ((math.exp(-0.5) - 0.5) + (math.e - 2.0)) / 4
    assert m["pg_loss"].item() == pytest.approx(-0.125, abs=1e-7)
    assert m["kl_loss"].item() == pytest.approx(kl, rel=1e-6) and kl == pytest.approx(0.10310, abs=1e-5)
    assert loss.item() == pytest.approx(-0.125 + kl, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Baselines (algorithm.md §7): GPPO, CISPO, the entropy bonus, verl's loss aggregations

VARIANTS = {name: L.LossSettings(**kw) for name, kw in VARIANT_KW.items()}


@pytest.mark.parametrize("r,a,f_ppo,f_aepo,f_gppo,f_cispo", [
    (1.5, 1.0, 0.0, 1.2, 1.2, 1.2),      # A > 0, r > 1 + eps_high: CISPO's weight is clip(r) = 1.2
    (0.5, -1.0, 0.0, 0.0, 0.8, 0.8),     # A < 0, r < 1 - eps_low: GPPO keeps weight 1 - eps_low
    (4.0, -1.0, 0.0, 0.0, 0.0, 1.2),     # A < 0, r > clip_c: the dual clip zeroes GPPO too; CISPO has none
    (2.0, -1.0, 2.0, 2.0, 2.0, 1.2),     # A < 0, 1 + eps_high < r < clip_c: min picks r·A
    (1.1, 1.0, 1.1, 1.1, 1.1, 1.1),      # inside the trust region
    (0.9, -1.0, 0.9, 0.9, 0.9, 0.9),     # inside, negative advantage
    (0.5, 2.0, 0.5, 0.5, 0.5, 0.8),      # A > 0, r < 1 - eps_low: min picks r·A; CISPO clips the weight up
    (1.5, -0.5, 1.5, 1.5, 1.5, 1.2),     # A < 0, r > 1 + eps_high: r·A; CISPO clips the weight down
])
def test_gradient_table_of_the_baselines(r, a, f_ppo, f_aepo, f_gppo, f_cispo):
    """∂loss/∂log π = −F·A/N_valid, F by hand per case (ε_l = ε_h = 0.2, c = 3)."""
    for name, f in zip(VARIANTS, (f_ppo, f_aepo, f_gppo, f_cispo)):
        assert _grad_weight(r, a, name) == pytest.approx(f, abs=1e-6), name


def test_gppo_lower_bound_and_dual_clip_interaction():
    """The lower sg bound acts where r < 1 − ε_l, the dual clip where r > c: with the dual clip off (c huge) a negative
    token at r = 4 keeps weight r; with c = 3 it has none, whatever the lower bound says. gppo_surrogate with
    sg_clip=False (the lower half alone) keeps the lower bound's gradient and drops the upper one's."""
    assert _grad_weight(4.0, -1.0, "gppo", clip_c=1e9) == pytest.approx(4.0, abs=1e-5)
    assert _grad_weight(4.0, -1.0, "gppo", clip_c=3.0) == 0.0
    assert _grad_weight(0.5, -1.0, "gppo", eps_low=0.3) == pytest.approx(0.7, abs=1e-6)
    for r, a, f in ((0.5, -1.0, 0.8), (1.5, 1.0, 0.0)):
        logp = torch.full((1, 1), math.log(r), requires_grad=True)
        L.gppo_surrogate(torch.exp(logp), torch.full((1, 1), a), sg_clip=False).sum().backward()
        assert logp.grad.item() / a == pytest.approx(f, abs=1e-6)


def test_cispo_bounds_like_minimax_no_lower_bound():
    """MiniMax-M1 sets ε_low large (no lower bound) and tunes ε_high: eps_low = 1 gives weight r below 1."""
    for r in (0.5, 0.01):
        assert _grad_weight(r, -1.0, "cispo", eps_low=1.0) == pytest.approx(r, rel=1e-5)
    assert _grad_weight(4.0, -1.0, "cispo", eps_low=1.0, eps_high=0.28) == pytest.approx(1.28, abs=1e-6)


def test_gppo_value_is_ppo_and_gradient_differs_only_on_lower_clipped_tokens():
    torch.manual_seed(7)
    logp = (torch.randn(4, 32) * 0.6).requires_grad_()
    old, adv = torch.randn(4, 32) * 0.6, torch.randn(4, 32)
    mask = (torch.rand(4, 32) > 0.2).float()
    ref = _textbook_ppo(logp, old, adv, mask, 77.0)
    (g_ref,) = torch.autograd.grad(ref, logp)
    loss, _ = L.policy_loss(logp, old, adv, mask, 77.0, VARIANTS["gppo"])
    (g,) = torch.autograd.grad(loss, logp)
    r = torch.exp(logp - old).detach()
    up = (adv > 0) & (r > 1.2) & (mask > 0)
    low = (adv < 0) & (r < 0.8) & (mask > 0)
    assert up.any() and low.any() and torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(g[~(up | low)], g_ref[~(up | low)], atol=1e-7)
    assert torch.allclose(g[up], -1.2 * adv[up] / 77.0, atol=1e-7)
    assert torch.allclose(g[low], -0.8 * adv[low] / 77.0, atol=1e-7)


def test_cispo_value_and_gradient_by_hand():
    """log π_old = −1, r = (1.5, 0.5, 1.1), A = (1, −1, 2): clip(r) = (1.2, 0.8, 1.1) and log π = log r − 1, so
    J = 1.2·(log 1.5 − 1) − 0.8·(log 0.5 − 1) + 2.2·(log 1.1 − 1) = −1.349242, loss = −J/4;
    ∂loss/∂log π = −clip(r)·A/4: the weight is a constant, no gradient through the ratio (inside the clip too)."""
    r = torch.tensor([[1.5, 0.5, 1.1]])
    logp = (r.log() - 1.0).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, m = L.policy_loss(logp, torch.full((1, 3), -1.0), adv, torch.ones(1, 3), 4, L.LossSettings(surrogate="cispo"))
    j = 1.2 * (math.log(1.5) - 1) - 0.8 * (math.log(0.5) - 1) + 2.2 * (math.log(1.1) - 1)
    assert loss.item() == pytest.approx(-j / 4, abs=1e-6) and j == pytest.approx(-1.349242, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(-j / 4, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.2 / 4, 0.8 / 4, -2.2 / 4]]), atol=1e-7)


def test_clip_metrics_per_variant_by_hand():
    """Seven tokens, one per region: (r, A) = (1.5, 1) upper, (0.5, −1) lower, (4, −1) dual, (1.1, 1) inside,
    (1.5, −.5) above 1+ε_h but not clipped (A < 0), (0.5, 2) below 1−ε_l (A > 0), (1, 0) no advantage.
    grad_dropped also equals the tokens with A ≠ 0 whose gradient autograd finds exactly 0."""
    r = torch.tensor([[1.5, 0.5, 4.0, 1.1, 1.5, 0.5, 1.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, -0.5, 2.0, 0.0]])
    expected = {"ppo": (0, 0, 3), "aepo": (1, 1, 2), "gppo": (1, 2, 1), "cispo": (1, 2, 0)}
    for name, (preserved, kept, dropped) in expected.items():
        logp = r.log().requires_grad_()
        loss, m = L.policy_loss(logp, torch.zeros(1, 7), adv, torch.ones(1, 7), 7, VARIANTS[name])
        loss.backward()
        count = {key: v.item() for key, v in m.items()}
        assert (count["clip_hi"], count["clip_lo"], count["clip_dual"]) == (1, 1, 1), name
        assert (count["out_hi"], count["out_lo"]) == (3, 2), name
        assert (count["preserved"], count["grad_kept"], count["grad_dropped"]) == (preserved, kept, dropped), name
        assert count["grad_dropped"] == ((logp.grad == 0) & (adv != 0)).sum().item(), name
        assert all(not v.requires_grad and v.dim() == 0 and v.dtype == torch.float64 for v in m.values())


# aggregation by hand: r = 1 so J = A; rows (1, 2, 3, [9]) and (4, [9, 9, 9]), brackets = mask 0; N_valid = 4,
# N_seq = 2, L = 8 (a constant, not the padded width 4)
AGG_CASES = [  # loss_agg, value, per-token weight of rows 0 and 1 (∂loss/∂log π = −A·w)
    ("token-mean", -10 / 4, (1 / 4, 1 / 4)),
    ("seq-mean-token-sum", -10 / 2, (1 / 2, 1 / 2)),
    ("seq-mean-token-mean", -(6 / 3 + 4 / 1) / 2, (1 / 6, 1 / 2)),
    ("seq-mean-token-sum-norm", -10 / (2 * 8), (1 / 16, 1 / 16)),
]


@pytest.mark.parametrize("loss_agg,value,weights", AGG_CASES)
def test_loss_aggregations_by_hand(loss_agg, value, weights):
    adv = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    logp = torch.zeros(2, 4, requires_grad=True)
    loss, m = L.policy_loss(logp, torch.zeros(2, 4), adv, mask, 4,
                            L.LossSettings(loss_agg=loss_agg, max_len=8), n_seqs=2)
    assert loss.item() == pytest.approx(value, abs=1e-6) and m["pg_loss"].item() == pytest.approx(value, abs=1e-6)
    loss.backward()
    w = torch.tensor(weights)[:, None] * mask
    assert torch.allclose(logp.grad, -adv * w, atol=1e-7)


@pytest.mark.parametrize("loss_agg", L.LOSS_AGGS)
def test_every_aggregation_gives_the_same_gradient_over_micro_batches(loss_agg):
    """Policy, KL and entropy terms together; uneven micro-batches, each padded to its own width (row 3, a micro-batch
    of its own, is 10 tokens long), with the global N_valid, N_seq and L."""
    torch.manual_seed(8)
    logp = (torch.randn(8, 20) * 0.5).requires_grad_()
    ent = (torch.rand(8, 20) * 2).requires_grad_()
    old, adv, ref = torch.randn(8, 20) * 0.5, torch.randn(8, 20), torch.randn(8, 20) * 0.5
    mask = (torch.rand(8, 20) > 0.3).float()
    mask[3, 10:] = 0
    kw = dict(n_seqs=8, settings=L.LossSettings("gppo", kl_coef=0.1, entropy_coef=0.01, loss_agg=loss_agg, max_len=32))
    full, _ = L.policy_loss(logp, old, adv, mask, mask.sum(), ref_logp=ref, entropy=ent, **kw)
    g_full = torch.autograd.grad(full, (logp, ent))
    acc, total = [torch.zeros_like(logp), torch.zeros_like(ent)], 0.0
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        width = int(mask[rows].nonzero()[:, 1].max()) + 1                # this micro-batch's own padding
        sl = (rows, slice(0, width))
        part, part_h = logp.detach()[sl].clone().requires_grad_(), ent.detach()[sl].clone().requires_grad_()
        l, _ = L.policy_loss(part, old[sl], adv[sl], mask[sl], mask.sum(), ref_logp=ref[sl], entropy=part_h, **kw)
        l.backward()
        acc[0][sl], acc[1][sl] = part.grad, part_h.grad
        total += l.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(acc[0], g_full[0], atol=1e-7) and torch.allclose(acc[1], g_full[1], atol=1e-7)


def test_kl_and_entropy_use_the_same_aggregation():
    """seq-mean-token-mean, A = 0: kl = 0.5·(k3_a/2 + k3_b/1)/2 with k3 at ref − logp = −0.5 (twice) and 1;
    entropy bonus = −0.1·((1 + 2)/2 + 4/1)/2."""
    logp = torch.tensor([[-1.0, -1.0, -2.0], [-2.0, 5.0, 5.0]])
    ref = torch.tensor([[-1.5, -1.5, -9.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 7.0], [4.0, 7.0, 7.0]])
    loss, m = L.policy_loss(logp, logp, torch.zeros(2, 3), mask, 3,
                            L.LossSettings(kl_coef=0.5, entropy_coef=0.1, loss_agg="seq-mean-token-mean"),
                            ref_logp=ref, entropy=ent, n_seqs=2)
    k_half, k_one = math.exp(-0.5) - 0.5, math.e - 2.0
    kl = 0.5 * ((2 * k_half) / 2 + k_one / 1) / 2
    bonus = -0.1 * ((1 + 2) / 2 + 4 / 1) / 2
    assert m["kl_loss"].item() == pytest.approx(kl, rel=1e-6)
    assert m["entropy_loss"].item() == pytest.approx(bonus, rel=1e-6)
    assert loss.item() == pytest.approx(kl + bonus, rel=1e-6)


def test_bad_loss_aggregation_raises():
    z, one = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="loss_agg must be one of token-mean, seq-mean-token-sum"):
        L.policy_loss(z, z, z, one, 2, L.LossSettings(loss_agg="seq-mean"))
    with pytest.raises(ValueError, match="needs n_seqs"):
        L.policy_loss(z, z, z, one, 2, L.LossSettings(loss_agg="seq-mean-token-mean"))
    with pytest.raises(ValueError, match="needs max_len"):
        L.policy_loss(z, z, z, one, 2, L.LossSettings(loss_agg="seq-mean-token-sum-norm"), n_seqs=1)


def test_entropy_bonus_gradient_is_minus_coeff_times_dH_dz():
    """With A = 0 the loss is −c·Σ H·m/N_valid. Its gradient on the logits is −c·(m/N)·∂H/∂z with, by hand,
    ∂H/∂z = −p ⊙ (log p + H); also equal to autograd through token_entropy on the full logits, and the chunked
    path from hidden states gives the same gradient. A small step down the loss raises the entropy."""
    torch.manual_seed(9)
    z = (torch.randn(2, 5, 11) * 2).requires_grad_()
    ids = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    c, n = 0.3, 6.0
    h = L.token_entropy(z)
    loss, m = L.policy_loss(L.token_logprobs(z, ids), L.token_logprobs(z, ids).detach(), torch.zeros(2, 5), mask, n,
                            L.LossSettings(entropy_coef=c), entropy=h)
    assert loss.item() == pytest.approx(-c * (h * mask).sum().item() / n, rel=1e-6)
    assert m["entropy_loss"].item() == pytest.approx(-c * (h * mask).sum().item() / n, rel=1e-6)
    (g,) = torch.autograd.grad(loss, z)
    logp_all = torch.log_softmax(z.detach(), -1)
    dh_dz = -logp_all.exp() * (logp_all + h.detach()[..., None])
    assert torch.allclose(g, -c * (mask / n)[..., None] * dh_dz, atol=1e-6)
    (g_auto,) = torch.autograd.grad((L.token_entropy(z) * mask).sum(), z)
    assert torch.allclose(g, -c / n * g_auto, atol=1e-6)
    # the chunked path (hidden states, LM head) gives the same gradient as the full logits
    hidden = torch.randn(10, 4, requires_grad=True)
    weight = torch.randn(11, 4, requires_grad=True)
    flat_ids, flat_mask = ids.reshape(-1), mask.reshape(1, -1)
    grads = []
    for path in ("chunked", "full"):
        if path == "chunked":
            lp, ent = L.logprobs_and_entropy(hidden, weight, flat_ids, chunk_size=3)
        else:
            logits = hidden @ weight.T
            lp, ent = L.token_logprobs(logits, flat_ids), L.token_entropy(logits)
        l, _ = L.policy_loss(lp[None], lp.detach()[None], torch.zeros(1, 10), flat_mask, n,
                             L.LossSettings(entropy_coef=c), entropy=ent[None])
        grads.append(torch.autograd.grad(l, (hidden, weight)))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))
    # descending the loss raises the entropy of the masked tokens
    with torch.no_grad():
        h_after = L.token_entropy(z - 1.0 * g)
    assert (h_after * mask).sum() > (h * mask).sum()
    # entropy_coeff = 0: not in the loss
    loss0, m0 = L.policy_loss(L.token_logprobs(z, ids), L.token_logprobs(z, ids).detach(), torch.zeros(2, 5), mask, n,
                              entropy=h)
    assert loss0.item() == 0.0 and m0["entropy_loss"].item() == 0.0
