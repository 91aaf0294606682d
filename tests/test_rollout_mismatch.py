"""Issue 24, item 1: the rollout–training mismatch of the rollout's record (``sampling/*`` metrics) and TRL's
importance-sampling corrections of it (``rollout_importance_sampling_*``).

* the metric is 0 for exact rollouts and equals an independent re-scoring of every recorded token for the prefix /
  dual cache (LLaDA and Dream shapes), whether π_old comes from the loss forward or the old-policy pass;
* the ratio, the corrected RLDF loss and the corrected trust-region loss equal slow references written here;
* the settings the correction cannot honour are refused with the field named.
"""

from __future__ import annotations

import math

import pytest
import torch

from dllm_trl import diffusion_generate
from dllm_trl.losses import RLDFLoss
from dllm_trl.losses.rldf_terms import INVALID_STEP, k3_kl, noisy_state
from dllm_trl.losses.rollout_mismatch import importance_sampling_ratio
from tests.tiny_models import build_tiny_dream, build_tiny_llada, build_tiny_sdar
from dllm_trl.toy.tokenizer import build_toy_tokenizer
from dllm_trl.trainers import DPPOMaskConfig, RLDFConfig

from .conftest import make_char_tokenizer, tiny_training_args
from .test_dppo_mask_trainer import digit_reward, make_trainer, tiny_diffusion
from .test_rldf_loss import (
    EPS_HIGH,
    EPS_LOW,
    GEN,
    _backward,
    _configure,
    _grads,
    _tiny_model,
    add_old_and_ref,
    loss_test_trainer,
    prepare_batch,
    random_batch,
    reference_state_logps,
    reference_targets,
)

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TEMPERATURE = 0.7
_TRAJECTORY = ("rollout_prompt_ids", "rollout_prompt_mask", "rollout_ids", "commit_step", "valid_mask",
               "sampled_steps", "rollout_commit_prob")


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer()


# --------------------------------------------------------------------------------------------------
# the metric on real rollouts
# --------------------------------------------------------------------------------------------------
def _model(family: str):
    tokenizer = make_char_tokenizer()
    ids = dict(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
               hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, seed=5)
    if family == "sdar":
        return build_tiny_sdar(block_size=4, num_key_value_heads=2, **ids)
    return (build_tiny_llada if family == "llada" else build_tiny_dream)(**ids)


def _rollout_batch(model, cache: str, seed: int = 0):
    """A rollout of 6 left-padded prompts (gen 8, blocks of 4, T = 0.7) and its RLDF batch: sampled states and
    targets (k = 4, c = 0.05, so that clean targets join the recorded ones)."""
    args = RLDFConfig("unused", max_completion_length=8, block_length=4, num_sampled_timesteps=4, cache_mode=cache,
                      temperature=TEMPERATURE, clean_target_threshold=0.05, use_cpu=True, report_to="none")
    loss = RLDFLoss(args)
    gen = torch.Generator().manual_seed(seed)
    content = list(range(3, len(make_char_tokenizer())))
    lengths = [3, 1, 4, 2, 4, 3]
    prompt_ids = torch.zeros(len(lengths), 4, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for b, n in enumerate(lengths):
        prompt_ids[b, 4 - n :] = torch.tensor(content)[torch.randint(len(content), (n,), generator=gen)]
        prompt_mask[b, 4 - n :] = 1
    with torch.no_grad():
        output = diffusion_generate(model, prompt_ids, prompt_mask, args.diffusion_generation_config(), gen)
        batch, _ = loss.sample_states(prompt_ids, prompt_mask, output, gen, torch.Generator().manual_seed(seed + 1))
        batch["advantages"] = torch.randn(len(lengths), generator=gen)
        block = getattr(model.config, "diffusion_block_size", None)
        batch["target_mask"] = loss.target_mask(batch, loss.score_states(model, batch), block)
    return loss, batch


def _metrics_from_loss_forward(model, loss, batch):
    rows, k = batch["sampled_steps"].shape
    call = loss.begin(batch, torch.ones(rows, k), 0.0, EPS_LOW, EPS_HIGH)
    assert call.sampling_logps is not None  # no old-policy pass: the loss forward measures
    steps = (batch["sampled_steps"] != INVALID_STEP).any(0).nonzero().squeeze(1).tolist()
    with torch.no_grad():
        for chunk in loss.loss_chunks(model, batch, steps):
            loss.chunk_loss(model, batch, chunk, call)
    return _as_values(loss.metric_sums(batch, call), loss.metric_extremes(batch, call))


def _metrics_from_old_pass(model, loss, batch):
    logps, extra = loss.score_for_policy_pass(model, batch, old_pass=True)
    assert set(extra) == {"old_sampling_logps"}
    batch = {**batch, **extra, "old_per_token_logps": logps}
    rows, k = batch["sampled_steps"].shape
    call = loss.begin(batch, torch.ones(rows, k), 0.0, EPS_LOW, EPS_HIGH)
    assert call.sampling_logps is None  # the old pass measured
    return _as_values(loss.metric_sums(batch, call), loss.metric_extremes(batch, call))


def _as_values(sums, extremes):
    values = {name: float(num) / max(float(den), 1.0) for name, (num, den, _) in sums.items()
              if name.startswith("sampling/")}
    values.update({name: float(value) for name, (value, _) in extremes.items()})
    return values


def _brute_force_mismatch(model, batch):
    """Every recorded token (committed at a sampled step t, valid) re-scored by hand: ``o_t`` built here, one plain
    full forward per state, the sampler's distribution written out (mask token excluded, logits / T)."""
    config = model.config
    shift = 1 if config.diffusion_logit_shift else 0
    P = batch["rollout_prompt_ids"].shape[1]
    diffs = []
    for b, j in (batch["sampled_steps"] != INVALID_STEP).nonzero().tolist():
        t = int(batch["sampled_steps"][b, j])
        steps, ids = batch["commit_step"][b].tolist(), batch["rollout_ids"][b].tolist()
        o_t = [config.mask_token_id if steps[i] >= t else ids[i] for i in range(GEN)]
        input_ids = torch.cat([batch["rollout_prompt_ids"][b], torch.tensor(o_t)]).unsqueeze(0)
        attention = torch.cat([batch["rollout_prompt_mask"][b], torch.ones(GEN, dtype=torch.long)]).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention).logits[0].float()
        for i in range(GEN):
            if steps[i] != t or not batch["valid_mask"][b, i]:
                continue
            row = logits[P + i - shift].clone()
            row[config.mask_token_id] = -math.inf
            trained = float((row / TEMPERATURE).log_softmax(-1)[ids[i]])
            diffs.append(trained - math.log(float(batch["rollout_commit_prob"][b, i])))
    assert diffs, "no recorded token was scored: the check is void"
    ratios = [math.exp(d) for d in diffs]
    kls = [r - 1 - d for r, d in zip(ratios, diffs)]
    return {
        "sampling/sampling_logp_difference/mean": sum(abs(d) for d in diffs) / len(diffs),
        "sampling/sampling_logp_difference/max": max(abs(d) for d in diffs),
        "sampling/kl_k3/mean": sum(kls) / len(kls),
        "sampling/kl_k3/max": max(kls),
        "sampling/importance_sampling_ratio/min": min(ratios),
        "sampling/importance_sampling_ratio/mean": sum(ratios) / len(ratios),
        "sampling/importance_sampling_ratio/max": max(ratios),
    }


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mismatch_matches_an_independent_rescoring(family, cache):
    """Prefix / dual cache: the logged metrics equal the brute-force re-scoring, from the loss forward (on-policy)
    and from the old-policy pass alike, and the mismatch is real (the cache is an approximation)."""
    model = _model(family)
    loss, batch = _rollout_batch(model, cache)
    expected = _brute_force_mismatch(model, batch)
    assert expected["sampling/sampling_logp_difference/max"] > 1e-4
    for got in (_metrics_from_loss_forward(model, loss, batch), _metrics_from_old_pass(model, loss, batch)):
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-4, abs=2e-6), name


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mismatch_is_zero_without_a_cache(family):
    """No cache: the sampler's forward is the training forward, so the record is exact."""
    model = _model(family)
    loss, batch = _rollout_batch(model, "none")
    for got in (_metrics_from_loss_forward(model, loss, batch), _metrics_from_old_pass(model, loss, batch)):
        assert got["sampling/sampling_logp_difference/max"] == 0.0
        assert got["sampling/kl_k3/max"] == 0.0
        assert got["sampling/importance_sampling_ratio/min"] == got["sampling/importance_sampling_ratio/max"] == 1.0


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_mismatch_is_zero_with_the_exact_block_cache(cache):
    """A block-diffusion model: its cache of finished blocks is exact. The packed training forward lays the states
    out differently from the sampler's cached calls, so float32 sums differ in order: 0 up to rounding (≤ 1 ulp of
    the log-probs here), against ~1e-3 for a bidirectional model's dual cache."""
    model = _model("sdar")
    loss, batch = _rollout_batch(model, cache)
    assert loss._packs(model)
    for got in (_metrics_from_loss_forward(model, loss, batch), _metrics_from_old_pass(model, loss, batch)):
        assert got["sampling/sampling_logp_difference/max"] <= 1e-6
        assert got["sampling/kl_k3/max"] <= 1e-12


def test_estimators_that_do_not_replay_the_rollout_log_no_mismatch():
    model = _model("llada")
    loss, batch = _rollout_batch(model, "dual")
    loss.args.policy_estimator = "all_masking"
    call = loss.begin(batch, torch.ones(batch["sampled_steps"].shape), 0.0, EPS_LOW, EPS_HIGH)
    assert call.sampling_logps is None
    assert not any(name.startswith("sampling/") for name in loss.metric_sums(batch, call))
    assert loss.metric_extremes(batch, call) == {}


# --------------------------------------------------------------------------------------------------
# the corrections against slow references
# --------------------------------------------------------------------------------------------------
def reference_ratio(train_logps, commit_prob, commit_step, valid_mask, sampled_steps, mode, low, high):
    """{(b, j, i): ρ} for every position, written from TRL's definitions with Python loops."""
    rows, k = sampled_steps.shape

    def recorded(b, j, i):
        t = int(sampled_steps[b, j])
        return t != INVALID_STEP and int(commit_step[b, i]) == t and bool(valid_mask[b, i])

    def bound(r):
        if mode.endswith("truncate"):
            r = r if low is None else max(r, low)
            return r if high is None else min(r, high)
        outside = (low is not None and r < low) or (high is not None and r > high)
        return 0.0 if outside else r

    out = {}
    for b in range(rows):
        if mode.startswith("sequence"):
            total = sum(float(train_logps[b, j, i]) - math.log(float(commit_prob[b, i]))
                        for j in range(k) for i in range(GEN) if recorded(b, j, i))
            seq = bound(math.exp(total))
        for j in range(k):
            for i in range(GEN):
                if mode.startswith("sequence"):
                    out[b, j, i] = seq
                elif recorded(b, j, i):
                    out[b, j, i] = bound(math.exp(float(train_logps[b, j, i]) - math.log(float(commit_prob[b, i]))))
                else:
                    out[b, j, i] = 1.0
    return out


def _random_record(tokenizer, seed):
    """A random trajectory (tests/test_rldf_loss.random_batch) with a random record μ(a) and a sampler-consistent
    log π_old that differs from it by ~0.3 nats."""
    batch = random_batch(tokenizer, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    rows, k = batch["sampled_steps"].shape
    batch["rollout_commit_prob"] = torch.rand(rows, GEN, generator=gen) * 0.9 + 0.05
    noise = 0.3 * torch.randn(rows, k, GEN, generator=gen)
    batch["old_sampling_logps"] = (batch["rollout_commit_prob"].log().unsqueeze(1) + noise).clamp_max(-1e-4)
    return batch


@pytest.mark.parametrize("bounds", [(0.8, 1.25), (None, 1.1), (0.9, None), (None, None)])
@pytest.mark.parametrize("mode", MODES)
def test_ratio_matches_the_reference(tokenizer, mode, bounds):
    batch = _random_record(tokenizer, seed=3)
    low, high = bounds
    recorded = ((batch["commit_step"].unsqueeze(1) == batch["sampled_steps"].unsqueeze(-1))
                & (batch["sampled_steps"].unsqueeze(-1) != INVALID_STEP) & batch["valid_mask"].bool().unsqueeze(1))
    got = importance_sampling_ratio(batch["old_sampling_logps"], batch["rollout_commit_prob"].log(), recorded, mode,
                                    low, high)
    want = reference_ratio(batch["old_sampling_logps"], batch["rollout_commit_prob"], batch["commit_step"],
                           batch["valid_mask"], batch["sampled_steps"], mode, low, high)
    expected = torch.tensor([[[want[b, j, i] for i in range(GEN)] for j in range(got.shape[1])]
                             for b in range(got.shape[0])])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if bounds == (0.8, 1.25) and mode.startswith("token"):  # the bounds bite on some tokens and not others
        inside = recorded & (got > 0.8) & (got < 1.25)
        assert inside.any() and (recorded & ~inside).any()


@pytest.fixture(scope="module")
def llada_loss_trainer(tokenizer, tmp_path_factory):
    return loss_test_trainer(_tiny_model("llada", tokenizer), tokenizer, str(tmp_path_factory.mktemp("mismatch")))


@pytest.mark.parametrize("mode", MODES)
def test_corrected_rldf_loss_matches_the_reference(llada_loss_trainer, tokenizer, mode):
    """PPO terms (an old-policy pass), token normalisation: ``−min(r A, clip(r) A) · ρ`` per target, ρ from the
    reference ratio (1 for the clean targets in token modes), loss and gradients."""
    trainer, model = llada_loss_trainer, llada_loss_trainer.model
    low, high = 0.8, 1.25
    batch = _random_record(tokenizer, seed=5)
    current = reference_state_logps(model, batch)
    batch = add_old_and_ref(batch, current, seed=6, ppo=True, beta=False)
    targets = reference_targets(batch, current, 0.2, ppo=True)
    rho = reference_ratio(batch["old_sampling_logps"], batch["rollout_commit_prob"], batch["commit_step"],
                          batch["valid_mask"], batch["sampled_steps"], mode, low, high)
    terms = []
    for (b, j), logps in current.items():
        A = float(batch["advantages"][b])
        for i in targets[b, j]:
            ratio = torch.exp(logps[i] - float(batch["old_per_token_logps"][b, j, i]))
            term = -torch.minimum(ratio * A, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * A)
            terms.append(term * rho[b, j, i])
    expected = sum(terms) / len(terms)
    assert len({round(rho[b, j, i], 6) for (b, j) in targets for i in targets[b, j]}) > 1  # ρ varies
    expected_grads = _grads(expected, [p for p in model.parameters() if p.requires_grad])

    _configure(trainer, norm="token", targets_from_loss=False)
    args = trainer.args
    args.rollout_importance_sampling_correction, args.rollout_importance_sampling_mode = True, mode
    args.rollout_importance_sampling_clip_min, args.rollout_importance_sampling_clip_max = low, high
    try:
        inputs = prepare_batch(trainer, batch, trajectory_keys=_TRAJECTORY)
        assert "importance_sampling_ratio" in inputs
        loss, grads = _backward(trainer, inputs)
    finally:
        args.rollout_importance_sampling_correction = False
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_corrected_trust_region_loss_matches_the_reference(tmp_path, mode):
    """DiffusionTrustRegionLoss with the decoupled correction (``behaviour_source="old"``), on-policy: the correction
    forces the old-policy pass; each target's masked term (μ = π_old's top-K, the sampler's distribution written out
    by hand over the full vocabulary) is multiplied by the reference ρ from π_old(a) and the record."""
    trainer = make_trainer(tmp_path, tiny_diffusion(), reward=digit_reward, max_steps=1, temperature=0.8, beta=0.0,
                           clean_target_threshold=0.05, bf16=False, behaviour_source="old",
                           rollout_importance_sampling_correction=True, rollout_importance_sampling_mode=mode,
                           rollout_importance_sampling_clip_min=0.995, rollout_importance_sampling_clip_max=1.003)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[0]["sampling/sampling_logp_difference/max"] > 1e-4  # tiny random LLaDA, dual cache
    inputs = trainer._buffered_inputs[0]
    assert "old_per_token_logps" in inputs and "old_topk_ids" in inputs  # forced although on-policy
    model, loss, top_k = trainer.model, trainer.loss, trainer.args.divergence_top_k
    rho = reference_ratio(inputs["old_behaviour_logps"], inputs["rollout_commit_prob"], inputs["commit_step"],
                          inputs["valid_mask"], inputs["sampled_steps"], mode, 0.995, 1.003)
    params = [p for p in model.parameters() if p.requires_grad]
    normalizer = trainer._loss_normalizer(inputs, "train")
    sampled, prompt = inputs["sampled_steps"], inputs["rollout_prompt_ids"]
    expected, used = torch.zeros(()), set()
    for b, j in (sampled != INVALID_STEP).nonzero().tolist():
        state = noisy_state(inputs["rollout_ids"][b : b + 1], inputs["commit_step"][b : b + 1], sampled[b, j].view(1),
                            loss.mask_token_id)
        ids = torch.cat([prompt[b : b + 1], state], dim=1)
        mask = torch.cat([inputs["rollout_prompt_mask"][b : b + 1], torch.ones_like(state)], dim=1)
        logits = model(input_ids=ids, attention_mask=mask).logits[0, prompt.shape[1] :].float()
        logits = logits.index_fill(-1, torch.tensor([loss.mask_token_id]), -math.inf)
        logp = (logits / 0.8).log_softmax(-1)
        for g in inputs["target_mask"][b, j].nonzero().squeeze(1).tolist():
            a = inputs["rollout_ids"][b, g]
            mu_ids, mu_logps = inputs["old_topk_ids"][b, j, g].long(), inputs["old_topk_logps"][b, j, g]
            support = logp[g].gather(-1, torch.cat([mu_ids.clamp(min=0), a.view(1)]))
            mu_a = inputs["old_behaviour_logps"][b, j, g].view(1)
            terms, _ = loss.masked_terms(support[None], mu_ids[None], mu_logps[None], a.view(1), mu_a,
                                         inputs["advantages"][b].view(1))
            expected = expected + terms[0] * rho[b, j, g] * normalizer[b, j]
            used.add(round(rho[b, j, g], 6))
    assert len(used) > 1  # the correction is not the identity on this batch
    want = torch.autograd.grad(expected, params)
    trainer.args.backward_mode = "per_micro_batch"
    got_loss = trainer._compute_loss(model, inputs)
    got = torch.autograd.grad(got_loss, params)
    torch.testing.assert_close(got_loss, expected, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# settings that are refused
# --------------------------------------------------------------------------------------------------
ON = dict(rollout_importance_sampling_correction=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rollout_importance_sampling_mode="token"), "rollout_importance_sampling_mode='token'"),
        (dict(rollout_importance_sampling_clip_max=-1.0), "rollout_importance_sampling_clip_max=-1.0"),
        (dict(rollout_importance_sampling_clip_min=float("nan")), "rollout_importance_sampling_clip_min=nan"),
        (dict(rollout_importance_sampling_clip_min=2.0, rollout_importance_sampling_clip_max=1.0),
         "rollout_importance_sampling_clip_min=2.0 exceeds"),
        (dict(ON, cache_mode="none"), "cache_mode='none'"),
        (dict(ON, policy_estimator="all_masking"), "policy_estimator='all_masking'"),
        (dict(ON, policy_estimator="random_masking"), "policy_estimator='random_masking'"),
        (dict(ON, temperature=0.0), "temperature=0.0"),
        (dict(vllm_importance_sampling_correction=False), "rollout_importance_sampling_"),
    ],
)
def test_rldf_config_refuses(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        tiny_training_args(RLDFConfig, tmp_path, **overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(ON), "behaviour_source='rollout'"),
        (dict(ON, behaviour_source="old", top_k=8), "top_k=8"),
        (dict(ON, behaviour_source="old", top_p=0.9), "top_p=0.9"),
        (dict(ON, behaviour_source="old", model_kind="causal"), "causal LM"),
    ],
)
def test_trust_region_config_refuses(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="rollout_importance_sampling_correction=True.*" + message):
        tiny_training_args(DPPOMaskConfig, tmp_path, **overrides)


def test_correction_is_refused_on_an_exact_block_cache(tmp_path):
    args = tiny_training_args(RLDFConfig, tmp_path, **ON)
    with pytest.raises(ValueError, match="rollout_importance_sampling_correction=True.*block-diffusion"):
        RLDFLoss(args).check_model(_model("sdar"))


def test_correction_is_refused_on_a_causal_model(tmp_path):
    """``model_kind="auto"`` lets the config through; the causal trainer it builds refuses (exact generate() cache)."""
    from dllm_trl.trainers import DPPOMaskTrainer

    from .conftest import addition_dataset
    from .test_dppo_mask_trainer import tiny_causal

    args = tiny_training_args(DPPOMaskConfig, tmp_path, behaviour_source="old", **ON)
    with pytest.raises(ValueError, match="rollout_importance_sampling_correction=True.*causal LM"):
        DPPOMaskTrainer(model=tiny_causal(), reward_funcs=digit_reward, args=args, train_dataset=addition_dataset(),
                        processing_class=make_char_tokenizer())


def test_defaults_keep_the_correction_off(tmp_path):
    args = tiny_training_args(RLDFConfig, tmp_path)
    assert args.cache_mode == "dual" and not args.rollout_importance_sampling_correction
    assert (args.rollout_importance_sampling_mode, args.rollout_importance_sampling_clip_min,
            args.rollout_importance_sampling_clip_max) == ("token_truncate", None, 3.0)
