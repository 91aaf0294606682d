"""benchmarks/trust_region.py: its direction-disagreement and direction-agreement helpers against brute-force
references, the Wilson interval, the fake-quantised rollout weights, the pooled direction analysis, and its quick
mode end to end on the causal Sudoku toy (with and without the rollout mismatch) and on the diffusion toy."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "trust_region.py"


@pytest.fixture(scope="module")
def trust_region():
    spec = importlib.util.spec_from_file_location("trust_region_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def brute_force_disagreement(div, direction, log_ratio, advantages, delta_low, delta_high):
    """Token by token in plain Python, from SPEC §3: outside iff D > δ (δ_high where A > 0); the predictive direction
    is the sign of g, the ratio direction the sign of r − 1; a mask drops a token iff outside and A·(direction) > 0."""
    sign = lambda x: (x > 0) - (x < 0)
    outside, direction_differs, decision_differs = [], [], []
    for d, g, lr, a in zip(div.tolist(), direction.tolist(), log_ratio.tolist(), advantages.tolist()):
        out = d > (delta_high if a > 0 else delta_low)
        ratio_minus_one = math.exp(lr) - 1.0
        outside.append(out)
        direction_differs.append(out and sign(g) != sign(ratio_minus_one))
        decision_differs.append(out and ((a * g > 0) != (a * ratio_minus_one > 0)))
    return outside, direction_differs, decision_differs


@pytest.mark.parametrize("delta_high", [None, 0.05])
def test_direction_disagreement_matches_brute_force(trust_region, delta_high):
    g = torch.Generator().manual_seed(0)
    n = 4000
    div = torch.rand(n, generator=g, dtype=torch.float64) * 0.3
    direction = torch.randn(n, generator=g, dtype=torch.float64) * 0.1
    log_ratio = torch.randn(n, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    advantages[::7] = 0.0  # zero-advantage tokens: both masks keep them, but their directions can still differ
    delta = 0.15
    parts = trust_region.direction_disagreement(div, direction, log_ratio, advantages, delta, delta_high=delta_high)
    outside, direction_differs, decision_differs = brute_force_disagreement(
        div, direction, log_ratio, advantages, delta, delta if delta_high is None else delta_high
    )
    assert parts["outside"].tolist() == outside
    assert parts["direction"].tolist() == direction_differs
    assert parts["decision"].tolist() == decision_differs
    # The random draw exercises every case: tokens inside and outside, agreeing and disagreeing, A = 0 among them.
    assert 0 < sum(decision_differs) < sum(direction_differs) < sum(outside) < n


def test_quick_mode_writes_the_result_fields(trust_region, tmp_path):
    store = trust_region.main(["--quick", "--models", "causal", "--methods", "predictive_uni", "--eval-size", "50",
                               "--rollout-quant", "none", "--top-k", "4", "--output-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "trust_region_quick.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(store["runs"]))
    assert (tmp_path / "trust_region_quick_table.md").read_text().count("| predictive, uniform tail | 1 |") == 1
    assert (tmp_path / "trust_region_quick.png").stat().st_size > 0
    assert saved["setup"]["steps"] == 3 and saved["setup"]["num_iterations"] == 4 and saved["setup"]["eval_size"] == 50
    assert 0.0 < saved["baseline"]["causal"] <= 1.0
    (run,) = saved["runs"]
    assert (run["model"], run["method"], run["seed"], run["steps"]) == ("causal", "predictive_uni", 0, 3)
    assert 0.0 <= run["solve_rate"] <= 1.0
    # 3 steps with a rollout reused 4 times: one rollout, then two off-policy updates.
    assert run["rollout_steps"] == [0] and len(run["rewards"]) == 1 and len(run["masked_frac_per_step"]) == 3
    # The first update is on-policy (μ is the sampling distribution itself): the mask cannot drop anything there.
    assert run["masked_frac_per_step"][0] == 0.0
    assert run["masked_frac"] == pytest.approx(sum(run["masked_frac_per_step"]) / 3)
    assert run["masked_frac_off_policy"] == pytest.approx(sum(run["masked_frac_per_step"][1:]) / 2)
    assert run["mu_from_rollout"] == 1.0
    assert 0 < run["tokens"] and 0 <= run["masked_tokens"] <= run["outside_tokens"] <= run["tokens"]
    assert 0 <= run["decision_disagree_tokens"] <= run["direction_disagree_tokens"] <= run["outside_tokens"]
    assert run["outside_frac"] == pytest.approx(run["outside_tokens"] / run["tokens"])
    if run["outside_tokens"]:
        share = run["direction_disagree_tokens"] / run["outside_tokens"]
        assert run["disagree_frac_of_outside"] == pytest.approx(share)
    assert 0 <= run["kept_but_ratio_clipped_tokens"] <= run["tokens"] - run["masked_tokens"]
    assert 0 < run["kept_weight_mean"] <= run["kept_weight_max"] <= 20.0  # the importance weight is truncated at C
    assert run["train_seconds"] > 0 and run["eval_seconds"] > 0
    # Issue 24: avg@8, the re-scored direction agreement and the D profile.
    assert saved["setup"]["eval_samples"] == 8 and saved["setup"]["rollout_quant"] == "none"
    assert 0.0 <= run["sampled_solve_rate"] <= 1.0 and 0.0 < saved["baseline_sampled"]["causal"] <= 1.0
    assert run["direction_rebuild_error"] < 1e-5  # g rebuilt from the records = the trainer's own
    for part in ("all", "kept", "off_policy"):
        c = run["direction_agreement"][part]
        assert 0 <= c["ratio_right"] <= c["tokens"] and 0 <= c["realised_up"] <= c["tokens"]
        for tail in ("agg", "uni"):
            assert c[f"{tail}_right_on_disagree"] + c[f"{tail}_tie_on_disagree"] <= c[f"{tail}_disagree"] <= c["tokens"]
    assert run["direction_agreement"]["all"]["tokens"] <= run["outside_tokens"]
    profile = run["divergence_profile"]
    assert sorted(profile["by_update"]) == ["0", "1", "2"]
    assert profile["by_update"]["0"]["max"] < 1e-3  # on-policy first update: μ is the training policy itself
    assert profile["by_update"]["2"]["q99"] >= profile["by_update"]["2"]["q50"] >= 0.0
    # The isolated first-order check measured every disagreeing out-of-region token, on a float64 copy that
    # reproduces the trainer's D.
    isolated = run["direction_agreement"]["isolated"]
    assert isolated["agg_disagree"] == run["direction_agreement"]["all"]["agg_disagree"]
    assert isolated["uni_disagree"] == run["direction_agreement"]["all"]["uni_disagree"]
    assert isolated["tokens"] <= run["direction_agreement"]["all"]["tokens"]
    assert run["isolated_check"] < 1e-4
    shares = list(profile["off_policy_share_above"].values())
    assert shares == sorted(shares, reverse=True) and all(0.0 <= v <= 1.0 for v in shares)


def test_quick_mode_with_rollout_mismatch_and_minibatches(trust_region, tmp_path):
    """Fake-FP8 rollout weights make μ differ from the training policy already at the first update."""
    store = trust_region.main(["--quick", "--models", "causal", "--methods", "dppo_topk_kl", "--eval-size", "20",
                               "--eval-samples", "2", "--rollout-quant", "fp8_e5m2", "--top-k", "2",
                               "--minibatches", "2", "--output-dir", str(tmp_path)])
    (run,) = store["runs"]
    assert store["setup"]["rollout_quant"] == "fp8_e5m2" and store["setup"]["minibatches"] == 2
    assert run["steps"] == 3 and run["rollout_steps"] == [0]
    assert run["divergence_profile"]["by_update"]["0"]["max"] > 1e-3
    assert run["divergence_profile"]["mu_tail_mean"] > 0  # K = 2 leaves behaviour mass outside the top-K
    assert "Direction agreement" in (tmp_path / "trust_region_quick_table.md").read_text()


def brute_force_agreement(div, div_after, g_agg, g_uni, log_ratio, advantages, delta, subset):
    """Token by token: outside (D > δ) with A ≠ 0; each criterion predicts sign(A)·sign(its quantity) for ΔD."""
    sign = lambda x: (x > 0) - (x < 0)
    counts = dict(tokens=0, realised_up=0, ratio_right=0)
    for tail in ("agg", "uni"):
        counts.update({f"{tail}_right": 0, f"{tail}_disagree": 0, f"{tail}_right_on_disagree": 0,
                       f"{tail}_tie_on_disagree": 0, f"{tail}_up_on_disagree": 0})
    rows = zip(div.tolist(), div_after.tolist(), g_agg.tolist(), g_uni.tolist(), log_ratio.tolist(),
               advantages.tolist(), subset)
    for d, d_after, ga, gu, lr, a, chosen in rows:
        if not (chosen and d > delta and a != 0):
            continue
        realised = sign(d_after - d)
        ratio = sign(a) * sign(math.exp(lr) - 1.0)
        counts["tokens"] += 1
        counts["realised_up"] += realised > 0
        counts["ratio_right"] += ratio == realised
        for tail, g in (("agg", ga), ("uni", gu)):
            predicted = sign(a) * sign(g)
            counts[f"{tail}_right"] += predicted == realised
            if predicted != ratio:
                counts[f"{tail}_disagree"] += 1
                counts[f"{tail}_right_on_disagree"] += predicted == realised
                counts[f"{tail}_tie_on_disagree"] += realised == 0
                counts[f"{tail}_up_on_disagree"] += realised > 0
    return counts


@pytest.mark.parametrize("use_subset", [False, True])
def test_direction_agreement_matches_brute_force(trust_region, use_subset):
    g = torch.Generator().manual_seed(1)
    n = 3000
    div = torch.rand(n, generator=g, dtype=torch.float64) * 0.3
    div_after = div + torch.randn(n, generator=g, dtype=torch.float64) * 0.05
    div_after[::11] = div[::11]  # ΔD = 0 exactly: right for no criterion
    g_agg = torch.randn(n, generator=g, dtype=torch.float64)
    g_uni = g_agg + torch.randn(n, generator=g, dtype=torch.float64) * 0.3  # mostly the same sign, not always
    log_ratio = torch.where(torch.rand(n, generator=g) < 0.8, g_agg, -g_agg) * 0.4  # the ratio sign agrees on ~80%
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    advantages[::7] = 0.0
    subset = torch.rand(n, generator=g) < 0.5 if use_subset else torch.ones(n, dtype=torch.bool)
    counts = trust_region.direction_agreement(div, div_after, g_agg, g_uni, log_ratio, advantages, 0.1,
                                              subset=subset if use_subset else None)
    assert counts == brute_force_agreement(div, div_after, g_agg, g_uni, log_ratio, advantages, 0.1,
                                           subset.tolist())
    # The draw has tokens of every kind: disagreeing, right and wrong on the disagreeing subset, and ties.
    for tail in ("agg", "uni"):
        assert 0 < counts[f"{tail}_right_on_disagree"] < counts[f"{tail}_disagree"] < counts["tokens"]
        assert counts[f"{tail}_tie_on_disagree"] > 0


def test_direction_agreement_hand_built_case(trust_region):
    """Four tokens outside δ = 0.1, one inside, one with A = 0; the predictive sign differs from the ratio's on three."""
    t = lambda *v: torch.tensor(v, dtype=torch.float64)
    div = t(0.2, 0.2, 0.2, 0.2, 0.05, 0.3)
    div_after = t(0.3, 0.1, 0.25, 0.2, 0.5, 0.0)  # realised: up, down, up, tie, (inside), (A = 0)
    log_ratio = t(0.1, 0.1, -0.1, 0.1, 0.1, 0.1)
    g = t(1.0, -1.0, 1.0, -1.0, 1.0, 1.0)
    advantages = t(1.0, 1.0, 1.0, -1.0, 1.0, 0.0)
    counts = trust_region.direction_agreement(div, div_after, g, g, log_ratio, advantages, 0.1)
    # ratio predicts up, up, down, down; predictive up, down, up, up: they differ on the last three, where the
    # predictive sign is right twice and the fourth token's ΔD is a tie.
    assert counts == dict(tokens=4, realised_up=2, ratio_right=1, agg_right=3, agg_disagree=3,
                          agg_right_on_disagree=2, agg_tie_on_disagree=1, agg_up_on_disagree=1, uni_right=3,
                          uni_disagree=3, uni_right_on_disagree=2, uni_tie_on_disagree=1, uni_up_on_disagree=1)


def test_wilson_interval_known_values(trust_region):
    low, high = trust_region.wilson_interval(8, 10)
    assert (low, high) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    low, high = trust_region.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    assert trust_region.wilson_interval(0, 0) is None


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_rollout_weights_are_rounded_then_restored(trust_region, kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    model.lm_head = torch.nn.Linear(8, 8)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    with trust_region.quantised_rollout_weights(model, kind) as rounded:
        assert rounded == 2  # the two hidden layers, not the LM head, not the biases
        weight = model[0].weight.detach().clone()
        assert not torch.equal(weight, original["0.weight"])
        assert torch.equal(trust_region.fake_quantise(weight, kind), weight)  # on the grid already
        relative = ((weight - original["0.weight"]).norm() / original["0.weight"].norm()).item()
        assert 0 < relative < {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1, "int8": 0.02}[kind]
        assert torch.equal(model.lm_head.weight, original["lm_head.weight"])
        assert torch.equal(model[0].bias, original["0.bias"])
    for name, p in model.named_parameters():
        assert torch.equal(p, original[name])


def test_direction_analysis_pools_counts_over_files(trust_region, tmp_path):
    """``--analysis direction`` sums the per-run counts of several study files, by method and over all mask runs."""
    keys = ("tokens", "realised_up", "ratio_right", "agg_right", "uni_right", "agg_disagree", "agg_right_on_disagree",
            "agg_tie_on_disagree", "agg_up_on_disagree", "uni_disagree", "uni_right_on_disagree",
            "uni_tie_on_disagree", "uni_up_on_disagree")
    counts = lambda *values: dict(zip(keys, values))
    setup = dict(delta=0.05, top_k=2, rollout_quant="fp8_e5m2", num_iterations=4, minibatches=1)
    first = dict(setup=setup, runs=[
        dict(method="dppo_topk_kl", seed=0, direction_agreement={"all": counts(100, 80, 70, 71, 70, 4, 3, 0, 3, 2, 1, 0, 1)}),
        dict(method="grpo_clip_higher", seed=0),  # no mask: left out
    ])
    second = dict(setup=dict(setup, delta=0.02), runs=[
        dict(method="dppo_topk_kl", seed=1, direction_agreement={"all": counts(50, 40, 30, 30, 31, 6, 2, 1, 4, 3, 3, 0, 2)}),
        dict(method="predictive_uni", seed=1, direction_agreement={"all": counts(10, 5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0)}),
    ])
    paths = []
    for name, store in (("a", first), ("b", second)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(store))
    report = trust_region.main(["--analysis", "direction", "--inputs", *map(str, paths), "--output-dir", str(tmp_path),
                                "--name", "pooled"])
    assert (tmp_path / "pooled_direction.md").read_text() == report
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines() if line.startswith("| ")}
    dppo = rows["DPPO top-K KL (ratio direction)"]
    assert "| 150 |" in dppo and "100/150 = 66.7%" in dppo and "5/10 = 50.0%" in dppo  # ratio right; agg. on disagree
    low, high = trust_region.wilson_interval(5, 10)
    assert f"[{100 * low:.1f}, {100 * high:.1f}]" in dppo
    assert "| 160 |" in rows["all mask runs"] and "GRPO" not in report
    assert "2 mask runs" in report and "1 mask runs" in report


def test_quick_mode_on_the_diffusion_toy_with_an_exact_rollout(trust_region, tmp_path):
    """The diffusion toy with no rollout cache: avg@N from its sampler at temperature 1, the cache mode recorded."""
    store = trust_region.main(["--quick", "--models", "diffusion", "--methods", "dppo_topk_kl", "--eval-size", "10",
                               "--eval-samples", "2", "--cache-mode", "none", "--output-dir", str(tmp_path)])
    (run,) = store["runs"]
    assert store["setup"]["cache_mode"] == "none" and 0.0 <= run["sampled_solve_rate"] <= 1.0
    assert 0.0 <= store["baseline_sampled"]["diffusion"] <= 1.0
    assert "direction_agreement" not in run  # the re-scoring is causal-only
    # No cache: the rollout's record is the training forward's distribution, so the first update masks nothing.
    assert run["masked_frac_per_step"][0] == 0.0


def test_defaults_are_the_main_calibrated_study(trust_region):
    """A bare run reproduces docs/trust_region.md's main table, not the withdrawn first study."""
    args = trust_region.parse_args([])
    assert (args.models, args.rollout_quant, args.top_k, args.delta) == (["causal"], "fp8_e5m2", 2, 0.05)
    assert args.seeds == list(range(10)) and args.name == "trust_region_stress_delta0.05"
    both = trust_region.parse_args(["--models", "causal", "diffusion"])
    assert both.rollout_quant == "none"  # the fake-quantised rollout is the causal toy's stress only
    assert trust_region.parse_args(["--quick"]).name == "trust_region_quick"



def test_diffusion_gemma_refuses_the_other_toys_stresses(trust_region):
    for flags in (["--cache-mode", "none"], ["--rollout-quant", "fp8_e5m2"], ["--minibatches", "2"]):
        with pytest.raises(SystemExit, match=flags[0]):
            trust_region.parse_args(["--models", "diffusion_gemma", *flags])
    both = trust_region.parse_args(["--models", "diffusion", "diffusion_gemma", "--cache-mode", "none"])
    assert both.cache_mode == "none"  # the masked-diffusion toy's cache, still settable beside it
    assert trust_region.parse_args([]).cache_mode == "dual"


def test_quick_mode_on_the_diffusion_gemma_toy(trust_region, tmp_path):
    """DiffusionGemma: a clipped surrogate and a divergence mask through its sampler and losses; its encoder cache is
    exact, so the first update of a rollout is on-policy and neither trust region drops anything there."""
    store = trust_region.main(["--quick", "--models", "diffusion_gemma", "--methods", "grpo_clip_higher",
                               "predictive_uni", "--eval-size", "10", "--output-dir", str(tmp_path)])
    assert store["setup"]["sampler_seeds"] == [0, 1, 2] and "cache_mode" not in store["setup"]
    assert 0.0 < store["baseline"]["diffusion_gemma"] <= 1.0 and "diffusion_gemma" not in store["baseline_sampled"]
    runs = {r["method"]: r for r in store["runs"]}
    for run in runs.values():
        assert run["model"] == "diffusion_gemma" and len(run["masked_frac_per_step"]) == 3
        assert run["masked_frac_per_step"][0] == 0.0 and run["sampled_solve_rate"] is None
    mask = runs["predictive_uni"]
    # μ of accepted tokens comes from the rollout's record, of clean targets from π_old: both kinds are there.
    assert 0.0 < mask["mu_from_rollout"] < 1.0 and mask["tokens"] > 0 and "direction_agreement" not in mask
    table = (tmp_path / "trust_region_quick_table.md").read_text()
    assert "### diffusion_gemma toy" in table and "solve rate (sampler-seed mean)" in table


# ---------------------------------------------------------------------------------------- vLLM mode (issue 33)
def test_rollout_mismatch_matches_plain_python(trust_region):
    old = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]])
    sampling = torch.tensor([[-0.4, -1.5, -2.0], [-0.3, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    pairs = [(-0.5, -0.4), (-1.0, -1.5), (-2.0, -2.0), (-0.1, -0.3)]  # the masked-in tokens, by hand
    gaps = [abs(o - s) for o, s in pairs]
    k3 = [math.exp(o - s) - 1 - (o - s) for o, s in pairs]
    out = trust_region.rollout_mismatch(old, sampling, mask)
    assert out["tokens"] == 4
    assert out["abs_logp_mean"] == pytest.approx(sum(gaps) / 4)
    assert out["abs_logp_max"] == pytest.approx(0.5)
    assert out["kl_k3_mean"] == pytest.approx(sum(k3) / 4)
    # q99 of [0, 0.1, 0.2, 0.5] with linear interpolation: 0.2 + 0.97 × 0.3
    assert out["abs_logp_q99"] == pytest.approx(0.2 + 0.97 * 0.3)
    with pytest.raises(ValueError, match="no sampled tokens"):
        trust_region.rollout_mismatch(old, sampling, torch.zeros_like(mask))


def test_mismatch_stats_match_brute_force(trust_region):
    """Each trust region's drop rule token by token (SPEC §3), against the vectorised shares."""
    generator = torch.Generator().manual_seed(0)
    n = 400
    tokens = dict(mu_logp=-torch.rand(n, generator=generator) * 3, div=torch.rand(n, generator=generator) * 0.2,
                  g_agg=torch.randn(n, generator=generator), g_uni=torch.randn(n, generator=generator),
                  advantages=torch.randn(n, generator=generator).round(decimals=1))
    tokens["pi_logp"] = tokens["mu_logp"] + torch.randn(n, generator=generator) * 0.3
    out = trust_region.mismatch_stats(tokens, deltas=(0.05, 0.15))
    rows = list(zip(*(tokens[k].tolist() for k in ("mu_logp", "pi_logp", "div", "g_agg", "g_uni", "advantages"))))
    share = lambda flags: sum(flags) / n
    for delta in (0.05, 0.15):
        assert out[f"outside_{delta:g}"] == pytest.approx(share(d > delta for _, _, d, *_ in rows))
        assert out[f"dropped_dppo_{delta:g}"] == pytest.approx(
            share(d > delta and a * (math.exp(p - m) - 1) > 0 for m, p, d, _, _, a in rows))
        assert out[f"dropped_predictive_agg_{delta:g}"] == pytest.approx(
            share(d > delta and a * g > 0 for _, _, d, g, _, a in rows))
        assert out[f"dropped_predictive_uni_{delta:g}"] == pytest.approx(
            share(d > delta and a * g > 0 for _, _, d, _, g, a in rows))
    outside = lambda m, p: not 0.8 <= math.exp(p - m) <= 1.28
    assert out["ratio_outside_clip_higher"] == pytest.approx(share(outside(m, p) for m, p, *_ in rows))
    assert out["dropped_clip_higher_vs_mu"] == pytest.approx(
        share(outside(m, p) and a * (math.exp(p - m) - 1) > 0 for m, p, _, _, _, a in rows))
    assert out["abs_logp_max"] == pytest.approx(max(abs(p - m) for m, p, *_ in rows))
    assert out["div_mean"] == pytest.approx(sum(d for _, _, d, *_ in rows) / n)
    assert out["tokens"] == n


def test_mismatch_sources_parse_and_refuse(trust_region):
    assert trust_region.parse_source("transformers") == dict(engine="transformers", quant="none", dtype="float32",
                                                             temperature=None)
    assert trust_region.parse_source("transformers:fp8_e5m2")["quant"] == "fp8_e5m2"
    assert trust_region.parse_source("vllm:bfloat16") == dict(engine="vllm", quant="none", dtype="bfloat16",
                                                              temperature=None)
    assert trust_region.parse_source("vllm:float32:T=0.6")["temperature"] == 0.6
    for bad, message in (("vllm:float16", "engine dtype"), ("vllm:bfloat16:0.6", "T=0.8"),
                         ("vllm:bfloat16:T=0", "> 0"), ("transformers:fp4", "quantisation"), ("sglang", "write")):
        with pytest.raises(ValueError, match=message):
            trust_region.parse_source(bad)
    for text in trust_region.MISMATCH_SOURCES:
        trust_region.parse_source(text)


def test_mismatch_markdown_lists_every_source_and_share(trust_region):
    row = dict(source="vllm:bfloat16", seconds=1.5, tokens=10, abs_logp_mean=0.001, abs_logp_q99=0.01,
               abs_logp_max=0.02, div_mean=1e-5, div_q99=1e-4, div_max=2e-4, ratio_outside_clip_higher=0.0,
               dropped_clip_higher_vs_mu=0.25)
    row.update({f"{kind}_{d:g}": 0.125 for d in (0.05,) for kind in
                ("outside", "dropped_dppo", "dropped_predictive_agg", "dropped_predictive_uni")})
    table = trust_region.mismatch_markdown([row, {**row, "source": "transformers"}], deltas=(0.05,))
    lines = table.splitlines()
    assert lines[2].startswith("| vllm:bfloat16 | 10 | 0.001 | 0.01 | 0.02 | 1e-05 | 0.0001 | 0.0002 | 0.00% | 1.5 |")
    assert "| transformers | 25.00% | 12.50% | 12.50% | 12.50% | 12.50% |" in table
    tables = [[line for line in block.splitlines() if line.startswith("|")] for block in table.split("\n\n")]
    tables = [rows for rows in tables if rows]
    assert [len(rows) for rows in tables] == [4, 4]  # header, rule, two sources
    for rows in tables:  # every row has its header's number of cells
        assert len({line.replace("\\|", "").count("|") for line in rows}) == 1


def test_vllm_mode_refuses_what_it_cannot_honour(trust_region):
    for flags, message in ((["--models", "causal", "diffusion"], "causal toy only"),
                           (["--rollout-quant", "fp8_e5m2"], "leave --rollout-quant out"),
                           (["--engine-temperature", "0"], "> 0")):
        with pytest.raises(SystemExit, match=message):
            trust_region.parse_args(["--rollout-engine", "vllm", *flags])
    with pytest.raises(SystemExit, match="add --rollout-engine vllm"):
        trust_region.parse_args(["--engine-temperature", "0.6"])
    args = trust_region.parse_args(["--rollout-engine", "vllm"])
    assert (args.rollout_quant, args.isolated_sample, args.engine_dtype) == ("none", -1, "bfloat16")
    assert trust_region.parse_args(["--rollout-engine", "vllm", "--isolated-sample", "2"]).isolated_sample == 2
    assert trust_region.parse_args([]).isolated_sample == 2  # the FP8 study's default is unchanged


@pytest.mark.vllm
def test_vllm_mode_trains_a_step_and_records_the_engine_mismatch(trust_region, tmp_path):
    """One rollout, two updates per method with a float32 colocated engine (one engine for the whole test, and the
    isolated direction check on): the mismatch fields are written, the two methods see the same first rollout at a seed (3: not the engine's own seed),
    and a float32 engine's μ is the trainer's π up to float noise, in the study and in the step-0 mismatch analysis."""
    pytest.importorskip("vllm")
    common = ["--rollout-engine", "vllm", "--engine-dtype", "float32", "--output-dir", str(tmp_path),
              "--eval-size", "4", "--num-generations", "4", "--prompts-per-step", "2"]
    store = trust_region.main([*common, "--steps", "2", "--num-iterations", "2", "--eval-samples", "2", "--seeds", "3",
                               "--methods", "grpo_clip_higher", "dppo_topk_kl", "--isolated-sample", "2",
                               "--name", "vllm_step"])
    saved = json.loads((tmp_path / "vllm_step.json").read_text())
    assert saved["setup"]["rollout_engine"] == "vllm" and saved["setup"]["engine_dtype"] == "float32"
    clip, mask = saved["runs"]
    assert (clip["method"], mask["method"]) == ("grpo_clip_higher", "dppo_topk_kl")
    for run in (clip, mask):
        (batch,) = run["rollout_mismatch"]  # one rollout batch
        assert batch["tokens"] > 0 and 0.0 <= batch["abs_logp_mean"] <= batch["abs_logp_max"] < 1e-4
    # The same first rollout at a seed (the two trainers' old-policy forwards differ in float noise only).
    assert clip["rewards"] == mask["rewards"]
    assert clip["rollout_mismatch"][0]["tokens"] == mask["rollout_mismatch"][0]["tokens"]
    assert mask["sampling_per_step"]["sampling/sampling_logp_difference/max"][0] < 1e-4
    assert store["runs"][1]["mu_from_rollout"] == 1.0
    # The second trainer of the process is wrapped in DistributedDataParallel (the engine initialised
    # torch.distributed): the isolated check still differentiates the policy, and its float64 copy agrees with D.
    assert "isolated" in mask["direction_agreement"] and mask["isolated_check"] < 1e-4
    rows = trust_region.main([*common, "--analysis", "mismatch", "--sources", "vllm:float32", "--name", "vllm_mm"])
    (row,) = rows
    assert row["source"] == "vllm:float32" and row["tokens"] > 0 and row["abs_logp_max"] < 1e-4
    assert row["dropped_dppo_0.05"] == 0.0
    assert "| vllm:float32 |" in (tmp_path / "vllm_mm_table.md").read_text()


def test_engine_mismatch_lines_average_runs_then_rollouts(trust_region):
    batch = lambda mean, q99, top, k3: dict(tokens=10, abs_logp_mean=mean, abs_logp_q99=q99, abs_logp_max=top,
                                            kl_k3_mean=k3)
    runs = [dict(method="dppo_topk_kl",
                 rollout_mismatch=[batch(0.001, 0.01, 0.1, 1e-5), batch(0.003, 0.03, 0.5, 3e-5)]),
            dict(method="dppo_topk_kl", rollout_mismatch=[batch(0.002, 0.02, 0.2, 2e-5)] * 2),
            dict(method="grpo_clip_higher")]  # a run without the field: no row
    lines = trust_region.engine_mismatch_lines(runs)
    (row,) = [line for line in lines if line.startswith("| DPPO")]
    # first rollouts 0.001, 0.002 -> 0.0015 ± 0.0007; per-run means 0.002, 0.002 -> 0.0020 ± 0.0000
    assert row == ("| DPPO top-K KL (ratio direction) | 4 | 0.0015 ± 0.0007 | 0.0020 ± 0.0000 | 0.020 ± 0.000 | 0.500 "
                   "| 0.00002 ± 0.00000 |")
    assert trust_region.engine_mismatch_lines([dict(method="dppo_topk_kl")]) == []
