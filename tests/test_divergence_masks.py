"""Tests for the divergence trust-region mask math (SPEC §3)."""

from __future__ import annotations

import math

import pytest
import torch

from tests import oracles
from dllm_trl.losses import divergence_masks as dm

F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# helpers (independent of the module under test)
# --------------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand_logps(gen, n, v, scale=1.0):
    return (torch.randn(n, v, generator=gen, dtype=F64) * scale).log_softmax(-1)


def _pair(gen, n, v, scale=1.0, noise=0.5):
    """Behaviour μ and a perturbed policy π (full log-probs) plus sampled actions a ~ μ."""
    mz = torch.randn(n, v, generator=gen, dtype=F64) * scale
    pz = mz + torch.randn(n, v, generator=gen, dtype=F64) * noise
    mu, pi = mz.log_softmax(-1), pz.log_softmax(-1)
    a = torch.multinomial(mu.exp(), 1, generator=gen).squeeze(-1)
    return mu, pi, a


def _topk_inputs(mu, a, k):
    lp, ids = mu.topk(k, dim=-1)
    return ids, lp, mu.gather(-1, a[:, None]).squeeze(-1)


def _view(mu, pi, a, k, binary=False):
    ids, lp, mu_a = _topk_inputs(mu, a, k)
    return dm.truncated_view_from_full(pi, ids, lp, a, mu_a, binary=binary)


def _kl_along(z, mu_logp, u, h):
    pi_logp = (z + h * u).log_softmax(-1)
    return (mu_logp.exp() * (mu_logp - pi_logp)).sum(-1)


def _tv_along(z, mu_logp, u, h):
    return 0.5 * ((z + h * u).softmax(-1) - mu_logp.exp()).abs().sum(-1)


def _fd4(f, h):
    """Fourth-order central difference of f at 0."""
    return (-f(2 * h) + 8 * f(h) - 8 * f(-h) + f(-2 * h)) / (12 * h)


def _direction(z, a):
    pi = z.softmax(-1)
    return torch.nn.functional.one_hot(a, z.shape[-1]).to(z.dtype) - pi


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


# --------------------------------------------------------------------------------------------------
# full-vocabulary directional derivative vs finite differences
# --------------------------------------------------------------------------------------------------
def _degenerate_cases(gen, n, v):
    """Random logits plus near-degenerate ones: peaked π, μ with tiny (≈1e-26) entries."""
    z = torch.randn(n, v, generator=gen, dtype=F64) * 2
    mz = torch.randn(n, v, generator=gen, dtype=F64) * 2
    z[: n // 2, 0] += 15.0  # peaked policy
    mz[n // 4 :, : v // 3] -= 60.0  # behaviour with tiny entries
    mz[n // 4 : n // 2, 0] += 15.0  # both peaked on token 0
    mu = mz.log_softmax(-1)
    a = torch.randint(0, v, (n,), generator=gen)
    a[: n // 4] = 0
    return z, mu, a


def test_kl_direction_full_matches_finite_difference():
    gen = _gen(0)
    z, mu, a = _degenerate_cases(gen, 64, 40)
    u = _direction(z, a)
    fd = _fd4(lambda h: _kl_along(z, mu, u, h), 1e-3)
    g = oracles.kl_direction_full(z.log_softmax(-1), mu, a)
    assert (g - fd).abs().max().item() < 1e-9
    # The spec's formula written out once more, independently: (π_a − μ_a) − Σ π(π − μ).
    pi, m = z.softmax(-1), mu.exp()
    ref = pi[torch.arange(64), a] - m[torch.arange(64), a] - (pi * (pi - m)).sum(-1)
    torch.testing.assert_close(g, ref, rtol=0, atol=1e-14)
    assert g.abs().max() > 1e-3  # non-trivial values


def test_tv_direction_full_matches_finite_difference_away_from_kinks():
    gen = _gen(1)
    z, mu, a = _degenerate_cases(gen, 96, 30)
    pi = z.softmax(-1)
    # keep rows where no π_v crosses μ_v within the stencil (|dπ_v/dh| ≤ 2π_v, stencil ±2h)
    ok = ((pi - mu.exp()).abs() > 1e-2 * pi).all(-1)
    assert ok.sum() >= 40
    z, mu, a = z[ok], mu[ok], a[ok]
    u = _direction(z, a)
    fd = _fd4(lambda h: _tv_along(z, mu, u, h), 1e-4)
    g = oracles.tv_direction_full(z.log_softmax(-1), mu, a)
    assert (g - fd).abs().max().item() < 1e-9
    assert g.abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------
# truncated-view estimators
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_estimators_equal_full_g_when_whole_vocabulary_retained(kind):
    gen = _gen(2)
    v = 50
    mu, pi, a = _pair(gen, 32, v, scale=2.0, noise=1.0)
    view = _view(mu, pi, a, k=v)
    assert (view.support_size == v).all()
    full = (oracles.kl_direction_full if kind == "kl" else oracles.tv_direction_full)(pi, mu, a)
    for tail in ("aggregated", "uniform"):
        est = dm.directional_derivative(view, kind, tail)
        torch.testing.assert_close(est, full, rtol=0, atol=1e-12)


def test_estimators_differ_only_by_tail_term():
    gen = _gen(3)
    v, k, n = 200, 10, 64
    mu, pi, a = _pair(gen, n, v, scale=1.5, noise=0.7)
    ids, lp, mu_a = _topk_inputs(mu, a, k)
    view = dm.truncated_view_from_full(pi, ids, lp, a, mu_a)
    g_agg, g_uni = dm.kl_direction(view, "aggregated"), dm.kl_direction(view, "uniform")
    t_agg, t_uni = dm.tv_direction(view, "aggregated"), dm.tv_direction(view, "uniform")
    pe, me = pi.exp(), mu.exp()
    for i in range(n):
        s = set(ids[i].tolist()) | {int(a[i])}
        pt = 1.0 - sum(pe[i, j].item() for j in s)
        mt = 1.0 - sum(me[i, j].item() for j in s)
        n_unseen = v - len(s)
        kl_tail = pt * (pt - mt)
        assert g_agg[i].item() - g_uni[i].item() == pytest.approx(-kl_tail * (1 - 1 / n_unseen), abs=1e-13)
        s_t = _sign(pt - mt)
        s_bar = sum(_sign(pe[i, j].item() - me[i, j].item()) * pe[i, j].item() for j in s) + s_t * pt
        tv_tail = 0.5 * pt * pt * (s_t - s_bar)
        assert t_agg[i].item() - t_uni[i].item() == pytest.approx(-tv_tail * (1 - 1 / n_unseen), abs=1e-13)
    assert (g_agg - g_uni).abs().max() > 1e-4


def test_uniform_tail_is_much_closer_on_spread_out_tails():
    gen = _gen(4)
    v, k = 2000, 20
    mu, pi, a = _pair(gen, 128, v, scale=1.0, noise=0.3)
    view = _view(mu, pi, a, k)
    assert view.mu_tail.mean() > 0.5  # spread-out tail
    full = oracles.kl_direction_full(pi, mu, a)
    err_agg = (dm.kl_direction(view, "aggregated") - full).abs().mean()
    err_uni = (dm.kl_direction(view, "uniform") - full).abs().mean()
    assert err_uni < 0.05 * err_agg
    assert err_uni < 5e-4
    full_tv = oracles.tv_direction_full(pi, mu, a)
    assert (dm.tv_direction(view, "uniform") - full_tv).abs().mean() < 0.2 * (
        dm.tv_direction(view, "aggregated") - full_tv
    ).abs().mean()


def test_binary_view_reduces_to_ratio_direction():
    gen = _gen(5)
    n, v = 4000, 64
    mu, pi, a = _pair(gen, n, v, scale=2.0, noise=1.0)
    mu_a = mu.gather(-1, a[:, None]).squeeze(-1)
    pi_a = pi.gather(-1, a[:, None]).squeeze(-1)
    view = _view(mu, pi, a, k=20, binary=True)
    assert (view.support_size == 1).all()
    p, m = pi_a.exp(), mu_a.exp()
    g = dm.kl_direction(view, "aggregated")
    torch.testing.assert_close(g, 2 * (1 - p) * (p - m), rtol=1e-10, atol=1e-14)
    # TV analogue: 2 sign(π_a − μ_a) π_a (1 − π_a)^2 (derivative of |π_a − μ_a| with a 2-bucket softmax)
    torch.testing.assert_close(
        dm.tv_direction(view, "aggregated"), 2 * torch.sign(p - m) * p * (1 - p) ** 2, rtol=1e-10, atol=1e-14
    )
    # binary divergences
    bkl = m * (m / p).log() + (1 - m) * ((1 - m) / (1 - p)).log()
    torch.testing.assert_close(dm.topk_kl(view), bkl, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(dm.binary_kl(p, m), bkl, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(dm.topk_tv(view), (p - m).abs(), rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(dm.binary_tv(p, m), (p - m).abs(), rtol=0, atol=0)
    # K = 0 is the same as binary=True
    empty = torch.empty(n, 0, dtype=torch.long)
    view0 = dm.truncated_view_from_full(pi, empty, empty.to(F64), a, mu_a)
    torch.testing.assert_close(dm.kl_direction(view0), g, rtol=0, atol=0)
    # so the predictive mask equals DPPO's mask exactly
    adv = torch.randn(n, generator=gen, dtype=F64)
    d = dm.topk_kl(view)
    delta = d.median().item()
    log_ratio = pi_a - mu_a
    pred = dm.predictive_mask(d, g, adv, delta)
    dppo = dm.dppo_mask(d, log_ratio, adv, delta)
    assert torch.equal(pred, dppo)
    assert 0.05 < (~dppo).double().mean() < 0.5  # the comparison is not vacuous
    pred_tv = dm.predictive_mask(dm.topk_tv(view), dm.tv_direction(view), adv, 0.05)
    assert torch.equal(pred_tv, dm.dppo_mask(dm.topk_tv(view), log_ratio, adv, 0.05))


def test_topk_divergences_lower_bound_full():
    gen = _gen(6)
    v = 100
    for k in (1, 5, 20, 60):
        mu, pi, a = _pair(gen, 500, v, scale=2.0, noise=1.0)
        view = _view(mu, pi, a, k)
        full_kl = (mu.exp() * (mu - pi)).sum(-1)
        full_tv = 0.5 * (pi.exp() - mu.exp()).abs().sum(-1)
        topk_kl, topk_tv = dm.topk_kl(view), dm.topk_tv(view)
        assert (topk_kl <= full_kl + 1e-12).all()
        assert (topk_tv <= full_tv + 1e-12).all()
        assert (topk_kl > 0).all() and (topk_tv > 0).all()
        torch.testing.assert_close(oracles.full_kl(mu, pi), full_kl)
        torch.testing.assert_close(oracles.full_tv(mu, pi), full_tv)
    # with K = V the top-K divergences are the full ones
    view = _view(mu, pi, a, v)
    torch.testing.assert_close(dm.topk_kl(view), full_kl, rtol=0, atol=1e-12)
    torch.testing.assert_close(dm.topk_tv(view), full_tv, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# support construction
# --------------------------------------------------------------------------------------------------
def test_support_adds_outside_action_and_does_not_duplicate_inside():
    gen = _gen(7)
    n, v, k = 200, 30, 5
    mu, pi, a = _pair(gen, n, v, scale=1.0, noise=0.5)
    ids, lp, mu_a = _topk_inputs(mu, a, k)
    a[: n // 2] = ids[: n // 2, 2]  # force half the actions inside the top-K
    mu_a = mu.gather(-1, a[:, None]).squeeze(-1)
    ids[::7, -1] = -1  # some padded top-K slots
    lp[::7, -1] = float("nan")  # padding values must not poison anything
    view = dm.truncated_view_from_full(pi, ids, lp, a, mu_a)
    pe, me = pi.exp(), mu.exp()
    n_outside = 0
    for i in range(n):
        s = {j for j in ids[i].tolist() if j >= 0} | {int(a[i])}
        n_outside += int(a[i]) not in set(ids[i].tolist())
        assert view.support_size[i].item() == len(s)
        assert view.valid[i, -1].item() == (int(a[i]) not in set(ids[i].tolist()))
        assert view.pi[i].sum().item() == pytest.approx(sum(pe[i, j].item() for j in s), abs=1e-13)
        assert view.mu[i].sum().item() == pytest.approx(sum(me[i, j].item() for j in s), abs=1e-13)
        assert view.pi_a[i].item() == pytest.approx(pe[i, a[i]].item(), rel=1e-12)
    assert 10 < n_outside < n // 2
    for t in (dm.topk_kl(view), dm.topk_tv(view), dm.kl_direction(view), dm.tv_direction(view, "uniform")):
        assert torch.isfinite(t).all()


def test_no_nan_at_zero_and_one_probabilities():
    # μ puts all its mass on the action (logp 0) and exactly 0 on another top-K slot;
    # π has exactly 0 on a support token and, in another row, probability 1 on the action.
    v = 6
    mu = torch.full((3, v), float("-inf"), dtype=F64)
    mu[:, 2] = 0.0
    pi = torch.tensor([[0.0, -1.0, -2.0, float("-inf"), -1.5, -3.0]], dtype=F64).log_softmax(-1).repeat(3, 1)
    pi[2] = float("-inf")
    pi[2, 2] = 0.0
    a = torch.tensor([2, 2, 2])
    ids = torch.tensor([[2, 3, 0], [3, 0, 1], [2, 3, 4]])
    lp = mu.gather(-1, ids)
    view = dm.truncated_view_from_full(pi, ids, lp, a, mu[:, 2])
    outs = [dm.topk_kl(view), dm.topk_tv(view)]
    outs += [dm.directional_derivative(view, kind, tail) for kind in ("kl", "tv") for tail in ("aggregated", "uniform")]
    outs += [dm.binary_kl(view.pi_a, view.mu_a), oracles.full_kl(mu, pi)]
    for view_b in (view, dm.truncated_view_from_full(pi, ids, lp, a, mu[:, 2], binary=True)):
        outs += [dm.topk_kl(view_b), dm.kl_direction(view_b)]
        outs += [*view_b[:-1]]
    for t in outs:
        assert torch.isfinite(t.double()).all()
    assert dm.topk_kl(view)[2].abs() < 1e-10  # identical (degenerate) distributions
    assert dm.topk_kl(view)[0] > 0


def test_dtypes():
    gen = _gen(8)
    mu, pi, a = _pair(gen, 4, 16)
    ids, lp, mu_a = _topk_inputs(mu, a, 3)
    v64 = dm.truncated_view_from_full(pi, ids, lp, a, mu_a)
    assert v64.pi.dtype == F64 and dm.topk_kl(v64).dtype == F64
    v32 = dm.truncated_view_from_full(pi.to(torch.bfloat16), ids, lp.to(torch.bfloat16), a, mu_a.to(torch.bfloat16))
    assert v32.pi.dtype == torch.float32 and dm.kl_direction(v32).dtype == torch.float32
    torch.testing.assert_close(dm.topk_kl(v32).double(), dm.topk_kl(v64), rtol=0.1, atol=0.02)


# --------------------------------------------------------------------------------------------------
# masks: hand-made truth tables
# --------------------------------------------------------------------------------------------------
def test_ppo_truth_table():
    # (A, r, expected keep) with eps_low = 0.2, eps_high = 0.3
    table = [
        (+1.0, 1.5, False),  # outside, pushes r further up
        (+1.0, 1.25, True),  # inside (upper bound is 1.3)
        (+1.0, 0.5, True),  # outside but corrective
        (+1.0, 0.9, True),  # inside
        (-1.0, 0.5, False),  # outside, pushes r further down
        (-1.0, 0.85, True),  # inside
        (-1.0, 1.5, True),  # outside but corrective
        (-1.0, 1.1, True),
        (0.0, 1.5, True),  # no advantage, no direction
        (0.0, 0.5, True),
    ]
    adv = torch.tensor([t[0] for t in table])
    log_ratio = torch.tensor([math.log(t[1]) for t in table])
    expected = torch.tensor([t[2] for t in table])
    assert torch.equal(dm.ppo_mask(log_ratio, adv, 0.2, 0.3), expected)
    assert torch.equal(dm.trust_region_mask("ppo", advantages=adv, log_ratio=log_ratio, eps_low=0.2, eps_high=0.3), expected)
    # symmetric ε = 0.2: r = 1.25 is now outside and outward for A > 0
    assert not dm.ppo_mask(log_ratio, adv, 0.2)[1]


@pytest.mark.parametrize("rule", ["dppo", "predictive"])
def test_divergence_mask_truth_table(rule):
    # (A, D, direction sign, expected keep) with δ_low = 0.1 (A < 0), δ_high = 0.3 (A > 0).
    # For dppo the direction sign is sign(r − 1); for predictive it is sign(g).
    table = [
        (+1.0, 0.5, +1, False),  # outside, outward
        (+1.0, 0.5, -1, True),  # outside, inward
        (+1.0, 0.2, +1, True),  # inside (δ_high = 0.3)
        (+1.0, 0.2, -1, True),
        (-1.0, 0.5, -1, False),  # outside, outward (A·x > 0)
        (-1.0, 0.5, +1, True),
        (-1.0, 0.2, -1, False),  # 0.2 > δ_low = 0.1: outside for A < 0
        (-1.0, 0.05, -1, True),  # inside
        (-1.0, 0.05, +1, True),
        (0.0, 0.5, +1, True),
        (0.0, 0.5, -1, True),
    ]
    adv = torch.tensor([t[0] for t in table])
    d = torch.tensor([t[1] for t in table])
    x = torch.tensor([0.7 * t[2] for t in table])
    expected = torch.tensor([t[3] for t in table])
    kwargs = {"log_ratio": x} if rule == "dppo" else {"direction": x}
    keep = dm.trust_region_mask(rule, advantages=adv, div=d, delta_low=0.1, delta_high=0.3, **kwargs)
    assert torch.equal(keep, expected)
    # a single δ = 0.3 for both sides: row 6 (D = 0.2, A < 0) is then inside
    keep = dm.trust_region_mask(rule, advantages=adv, div=d, delta=0.3, **kwargs)
    assert keep[6] and torch.equal(keep[[0, 1, 4, 5]], expected[[0, 1, 4, 5]])


def test_hand_example_where_ratio_and_predictive_directions_disagree():
    # V = 3, a = 0, μ = (0.2, 0.7, 0.1), π = (0.3, 0.1, 0.6): r = 1.5 (ratio says "outward" for A > 0) but
    # g = (0.3 − 0.2) − [0.3·0.1 + 0.1·(−0.6) + 0.6·0.5] = 0.1 − 0.27 = −0.17 < 0 (KL shrinks).
    # KL = 0.2 ln(2/3) + 0.7 ln 7 + 0.1 ln(1/6) ≈ 1.1019 > δ = 0.15.
    mu = torch.tensor([[0.2, 0.7, 0.1]] * 2, dtype=F64).log()
    pi = torch.tensor([[0.3, 0.1, 0.6]] * 2, dtype=F64).log()
    a = torch.tensor([0, 0])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    view = _view(mu, pi, a, k=3)  # whole vocabulary, so estimators are exact
    assert dm.topk_kl(view)[0].item() == pytest.approx(0.2 * math.log(2 / 3) + 0.7 * math.log(7) + 0.1 * math.log(1 / 6), abs=1e-12)
    assert dm.kl_direction(view)[0].item() == pytest.approx(-0.17, abs=1e-12)
    log_ratio = pi[:, 0] - mu[:, 0]
    d, g = dm.topk_kl(view), dm.kl_direction(view)
    keep_dppo = dm.trust_region_mask("dppo", advantages=adv, log_ratio=log_ratio, div=d, delta=0.15)
    keep_pred = dm.trust_region_mask("predictive", advantages=adv, div=d, direction=g, delta=0.15)
    keep_ppo = dm.trust_region_mask("ppo", advantages=adv, log_ratio=log_ratio, eps_low=0.2)
    assert keep_dppo.tolist() == [False, True]
    assert keep_ppo.tolist() == [False, True]
    assert keep_pred.tolist() == [True, False]
    m = oracles.mask_metrics(keep_pred, adv, div=d, log_ratio=log_ratio, direction=g)
    assert m["direction_disagree_frac"].item() == 1.0


# --------------------------------------------------------------------------------------------------
# masks: brute-force per-token reference
# --------------------------------------------------------------------------------------------------
def _reference_token(pi_row, ids_row, lp_row, a, mu_a_logp, adv, v, cfg):
    """Slow per-token reference with Python sets and floats."""
    s_ids = set(ids_row)
    mu_s = {j: math.exp(l) for j, l in zip(ids_row, lp_row)}
    if a not in s_ids:
        mu_s[a] = math.exp(mu_a_logp)
    pi_s = {j: math.exp(pi_row[j]) for j in mu_s}
    mt = max(1.0 - sum(mu_s.values()), 1e-12)
    pt = max(1.0 - sum(pi_s.values()), 1e-12)
    kl = sum(m * math.log(m / pi_s[j]) for j, m in mu_s.items()) + mt * math.log(mt / pt)
    tv = 0.5 * (sum(abs(pi_s[j] - m) for j, m in mu_s.items()) + abs(pt - mt))
    pa, ma = math.exp(pi_row[a]), math.exp(mu_a_logp)
    n_unseen = v - len(mu_s)
    seen = sum(pi_s[j] * (pi_s[j] - mu_s[j]) for j in mu_s)
    g = {
        ("kl", "aggregated"): (pa - ma) - (seen + pt * (pt - mt)),
        ("kl", "uniform"): (pa - ma) - (seen + pt * (pt - mt) / n_unseen),
    }
    sg = {j: _sign(pi_s[j] - mu_s[j]) for j in mu_s}
    st = _sign(pt - mt)
    sbar = sum(sg[j] * pi_s[j] for j in mu_s) + st * pt
    seen_tv = sum(pi_s[j] ** 2 * (sg[j] - sbar) for j in mu_s)
    for tail, c in (("aggregated", 1.0), ("uniform", 1.0 / n_unseen)):
        g[("tv", tail)] = 0.5 * ((_sign(pa - ma) - sbar) * pa - seen_tv - c * pt * pt * (st - sbar))
    r = math.exp(pi_row[a] - mu_a_logp)
    ratio_out = adv * (r - 1) > 0
    keep = {"ppo": not ((r < 1 - cfg["eps_low"] or r > 1 + cfg["eps_high"]) and ratio_out)}
    for kind, d in (("kl", kl), ("tv", tv)):
        delta = cfg["delta_high"][kind] if adv > 0 else cfg["delta_low"][kind]
        keep[("dppo", kind)] = not (d > delta and ratio_out)
        for tail in ("aggregated", "uniform"):
            keep[("predictive", kind, tail)] = not (d > delta and adv * g[(kind, tail)] > 0)
    return {"kl": kl, "tv": tv, "g": g, "keep": keep}


def test_vectorised_masks_match_bruteforce_reference():
    gen = _gen(9)
    n, v, k = 300, 40, 4
    mu, pi, a = _pair(gen, n, v, scale=1.5, noise=0.1)
    # mix small and large policy moves so that proximity is both in and out
    pi = (pi + (torch.rand(n, 1, generator=gen, dtype=F64) * 3) * torch.randn(n, v, generator=gen, dtype=F64)).log_softmax(-1)
    ids, lp, mu_a = _topk_inputs(mu, a, k)
    adv = torch.randn(n, generator=gen, dtype=F64)
    cfg = {"eps_low": 0.2, "eps_high": 0.28, "delta_low": {"kl": 0.1, "tv": 0.15}, "delta_high": {"kl": 0.2, "tv": 0.25}}
    view = dm.truncated_view_from_full(pi, ids, lp, a, mu_a)
    log_ratio = pi.gather(-1, a[:, None]).squeeze(-1) - mu_a
    refs = [
        _reference_token(pi[i].tolist(), ids[i].tolist(), lp[i].tolist(), int(a[i]), mu_a[i].item(), adv[i].item(), v, cfg)
        for i in range(n)
    ]
    got = {"ppo": dm.trust_region_mask("ppo", advantages=adv, log_ratio=log_ratio, eps_low=0.2, eps_high=0.28)}
    for kind in ("kl", "tv"):
        d = dm.divergence(view, kind)
        torch.testing.assert_close(d, torch.tensor([r[kind] for r in refs], dtype=F64), rtol=1e-10, atol=1e-13)
        dl, dh = cfg["delta_low"][kind], cfg["delta_high"][kind]
        got[("dppo", kind)] = dm.trust_region_mask(
            "dppo", advantages=adv, log_ratio=log_ratio, div=d, delta_low=dl, delta_high=dh
        )
        for tail in ("aggregated", "uniform"):
            g = dm.directional_derivative(view, kind, tail)
            torch.testing.assert_close(g, torch.tensor([r["g"][(kind, tail)] for r in refs], dtype=F64), rtol=1e-9, atol=1e-13)
            got[("predictive", kind, tail)] = dm.trust_region_mask(
                "predictive", advantages=adv, div=d, direction=g, delta_low=dl, delta_high=dh
            )
    for key, keep in got.items():
        expected = torch.tensor([r["keep"][key] for r in refs])
        assert torch.equal(keep, expected), key
        assert 0 < (~expected).sum() < n  # both outcomes occur
    # predictive and dppo disagree somewhere on this batch (otherwise the comparison is weak)
    assert not torch.equal(got[("dppo", "kl")], got[("predictive", "kl", "aggregated")])


# --------------------------------------------------------------------------------------------------
# loss terms and metrics
# --------------------------------------------------------------------------------------------------
def test_masked_policy_gradient_terms_gradients():
    gen = _gen(10)
    n, cap = 64, 2.0
    logp = (-torch.rand(n, generator=gen, dtype=F64) * 3).requires_grad_(True)
    mu_logp = logp.detach() + torch.randn(n, generator=gen, dtype=F64)  # ratios on both sides of the cap
    adv = torch.randn(n, generator=gen, dtype=F64)
    keep = torch.rand(n, generator=gen) > 0.3
    terms, w = dm.masked_policy_gradient_terms(logp, mu_logp, adv, keep, is_cap=cap)
    assert not w.requires_grad
    terms.sum().backward()
    w_ref = torch.minimum(torch.exp(logp.detach() - mu_logp), torch.tensor(cap, dtype=F64))
    assert (w_ref == cap).any() and (w_ref < cap).any()
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(logp.grad, -keep.to(F64) * w_ref * adv)
    torch.testing.assert_close(terms.detach(), -keep.to(F64) * w_ref * adv * logp.detach())
    # no cap
    _, w_nocap = dm.masked_policy_gradient_terms(logp, mu_logp, adv, keep, is_cap=None)
    torch.testing.assert_close(w_nocap, torch.exp(logp.detach() - mu_logp))


def test_masked_terms_ignore_non_finite_masked_tokens():
    logp = torch.tensor([-1.0, float("-inf"), -0.5], dtype=F64, requires_grad=True)
    mu_logp = torch.tensor([-1.2, float("nan"), -0.5], dtype=F64)
    adv = torch.tensor([1.0, 2.0, float("nan")], dtype=F64)
    keep = torch.tensor([True, False, False])
    terms, _ = dm.masked_policy_gradient_terms(logp, mu_logp, adv, keep, is_cap=20.0)
    terms.sum().backward()
    assert torch.isfinite(terms).all() and torch.isfinite(logp.grad).all()
    assert terms[1:].eq(0).all() and logp.grad[1:].eq(0).all()
    assert logp.grad[0].item() == pytest.approx(-math.exp(0.2))


def test_mask_metrics():
    keep = torch.tensor([True, False, False, True, False, True])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -2.0, 5.0])
    valid = torch.tensor([True, True, True, True, True, False])
    div = torch.tensor([0.1, 0.3, 0.2, 0.0, 0.4, float("nan")])
    log_ratio = torch.tensor([0.1, -0.2, 0.3, -0.1, 0.2, 1.0])
    g = torch.tensor([0.5, -0.1, -0.3, -0.2, 0.1, float("nan")])
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 100.0])
    m = oracles.mask_metrics(keep, adv, valid=valid, div=div, log_ratio=log_ratio, direction=g, weights=w)
    assert m["masked_frac"].item() == pytest.approx(3 / 5)
    assert m["masked_frac_pos"].item() == pytest.approx(1 / 2)
    assert m["masked_frac_neg"].item() == pytest.approx(2 / 3)
    assert m["divergence_mean"].item() == pytest.approx(1.0 / 5)
    assert m["direction_disagree_frac"].item() == pytest.approx(1 / 5)  # only token 2
    assert m["is_weight_mean"].item() == pytest.approx(3.0)
    empty = oracles.mask_metrics(keep, adv, valid=torch.zeros(6, dtype=torch.bool))
    assert empty["masked_frac"].item() == 0.0


def test_binary_tail_is_accurate_in_float32_near_one():
    # LLM tokens often have p(a) ≈ 1: 1 − p must not be lost to float32 rounding.
    mu_a = torch.tensor([-1e-6, -3e-7], dtype=torch.float32)
    pi_a = torch.tensor([-2e-6, -1e-7], dtype=torch.float32)
    ids = torch.zeros(2, 0, dtype=torch.long)
    view = dm.truncated_view(ids, ids.float(), torch.tensor([5, 7]), mu_a, pi_a[:, None])
    torch.testing.assert_close(view.mu_tail, torch.tensor([1e-6, 3e-7]), rtol=1e-4, atol=0)
    torch.testing.assert_close(view.pi_tail, torch.tensor([2e-6, 1e-7]), rtol=1e-4, atol=0)
    # binary KL agrees with a float64 evaluation of the formula
    m, p = mu_a.double().exp(), pi_a.double().exp()
    ref = m * (m / p).log() + (1 - m) * ((1 - m) / (1 - p)).log()
    torch.testing.assert_close(dm.topk_kl(view).double(), ref, rtol=1e-3, atol=1e-10)


@pytest.mark.parametrize("excluded", [None, 3])
def test_support_log_probs_match_the_full_log_softmax_in_chunks(excluded):
    """Chunked, recomputed view at the support = gather from the full log-softmax (values and gradients)."""
    from dllm_trl.losses.divergence_masks import support_log_probs

    torch.manual_seed(0)
    n, d, vocab, k, temperature = 37, 8, 50, 5, 0.7
    head = torch.nn.Linear(d, vocab, bias=False, dtype=torch.float64)
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, vocab, (n, k))
    ids[0, -1] = -1  # padding slot
    action = torch.randint(0, vocab, (n,))
    use_own = torch.rand(n) < 0.5
    view = support_log_probs(hidden, head, ids, action, temperature=temperature, excluded_id=excluded, own_topk=k,
                             use_own=use_own, chunk_elements=4 * vocab)  # 10 chunks of 4 positions
    logits = head(hidden)
    scaled = logits / temperature
    if excluded is not None:
        scaled = scaled.index_fill(-1, torch.tensor([excluded]), float("-inf"))
    logps = scaled.log_softmax(-1)
    own_values, own_ids = logps.detach().topk(k, dim=-1)
    slots = torch.cat([torch.where(use_own[:, None], own_ids, ids).clamp(min=0), action[:, None]], dim=-1)
    expected = logps.gather(-1, slots)
    raw = logits.log_softmax(-1).gather(-1, action[:, None]).squeeze(-1)
    torch.testing.assert_close(view.support, expected.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(view.raw_action, raw.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(view.own_logps, own_values.float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(view.own_ids, own_ids)
    weights = torch.randn(n, k + 1, dtype=torch.float64)
    got = torch.autograd.grad((view.support.double() * weights).sum() + view.raw_action.double().sum(),
                              [hidden, head.weight])
    want = torch.autograd.grad((expected * weights).sum() + raw.sum(), [hidden, head.weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
