"""Tests for the policy estimators (SPEC §2.4, paper 1 App. A): rldf, sequential, all_masking, random_masking.

1. The tensor functions of :mod:`dllm_trl.losses.estimators` against a brute-force reference written plainly from
   the documented draws: one ``torch.Generator`` per row seeded with its ``mask_seed`` (ratio, then completion
   draws, then prompt draws), Python sets for masks and targets, scalar formulas for the weights.
2. The random-masking weights are inverse inclusion probabilities: Monte Carlo checks of the probability and of the
   unbiasedness of ``Σ_{targets} w ℓ`` for ``Σ_{valid} ℓ`` (single mask and complementary pair).
3. A real tiny ``RLDFTrainer``: loss and gradients of each estimator against a brute-force loop (states built by
   hand, one plain forward per state, weighted aggregation of Eq. 10 / Eq. 13).
4. Mask consistency: in a real ``train()`` with ``num_iterations = 2`` and gradient accumulation, the old-policy,
   reference and every loss pass see the same states for a row, and at the first iteration ratios are exactly 1.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from datasets import Dataset

from dllm_trl.losses import estimators as est
from dllm_trl.losses.rldf_terms import INVALID_STEP
from tests.tiny_models import build_tiny_llada
from dllm_trl.trainers import RLDFConfig, RLDFTrainer
from dllm_trl.losses import rldf_loss as rldf_loss_module

from .conftest import addition_dataset, length_reward, make_char_tokenizer
from .test_rldf_loss import ACCUM, EPS_HIGH, EPS_LOW, GEN, prepare_batch, random_batch, trainable_params

EPS = est.RANDOM_MASK_EPS
TRAJECTORY = ("rollout_prompt_ids", "rollout_prompt_mask", "rollout_ids", "commit_step", "valid_mask")


@pytest.fixture(scope="module")
def tokenizer():
    from dllm_trl.toy.tokenizer import build_toy_tokenizer

    return build_toy_tokenizer()


def _seeds(rows, seed=0):
    return torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# brute-force reference of the documented draws and sets
# --------------------------------------------------------------------------------------------------
def ref_draws(seed: int, gen: int, prompt_len: int):
    g = torch.Generator().manual_seed(int(seed))
    r = float(torch.rand(1, dtype=torch.float64, generator=g))
    t = EPS + (1 - EPS) * (1 - r)
    u = torch.rand(gen, dtype=torch.float64, generator=g).tolist()
    v = torch.rand(prompt_len, dtype=torch.float64, generator=g).tolist()
    return t, u, v


def ref_random_mask(seed: int, valid: list[int], gen: int) -> tuple[set, float]:
    """(positions masked by state 0, ratio t): u_i < t, or else the valid position with the smallest u."""
    t, u, _ = ref_draws(seed, gen, 0)
    masked = {i for i in range(gen) if u[i] < t}
    if valid and not masked & set(valid):
        masked.add(min(valid, key=lambda i: u[i]))
    return masked, t


def ref_state_targets_weights(estimator, batch, b, step, *, clean_prob=None, c=0.2, prompt_p=0.0, mask_id=None):
    """(prompt list, state list, sorted targets, {target: weight}) of row ``b`` at ``step`` (step id or t)."""
    gen = batch["rollout_ids"].shape[1]
    ids = batch["rollout_ids"][b].tolist()
    steps = batch["commit_step"][b].tolist()
    valid = [i for i in range(gen) if batch["valid_mask"][b, i]]
    prompt = batch["rollout_prompt_ids"][b].tolist()
    seed = int(batch["mask_seed"][b]) if "mask_seed" in batch else None
    if estimator in ("rldf", "sequential"):
        state = [mask_id if steps[i] >= step else ids[i] for i in range(gen)]
        now = {i for i in range(gen) if steps[i] == step}
        later = {i for i in range(gen) if steps[i] > step and clean_prob is not None and float(clean_prob[i]) >= c}
        targets = now | later if estimator == "rldf" else now
        return prompt, state, sorted(targets & set(valid)), {}
    if estimator == "all_masking":
        if prompt_p > 0:
            P = len(prompt)
            _, _, v = ref_draws(seed, gen, P)
            prompt = [
                mask_id if batch["rollout_prompt_mask"][b, P - 1 - n] and v[n] < prompt_p else prompt[P - 1 - n]
                for n in range(P)
            ][::-1]
        return prompt, [mask_id] * gen, valid, {}
    masked, t = ref_random_mask(seed, valid, gen)
    L = len(valid)
    pi = 1.0 if L <= 1 else t + (1 - t) ** L / L
    if step == 1:
        masked, pi = set(range(gen)) - masked, 1 - pi
    state = [mask_id if i in masked else ids[i] for i in range(gen)]
    targets = sorted(masked & set(valid))
    return prompt, state, targets, {i: 1 / pi for i in targets}


# --------------------------------------------------------------------------------------------------
# 1. tensor functions against the reference
# --------------------------------------------------------------------------------------------------
def test_row_draws_depend_on_the_seed_only():
    seeds = _seeds(7, seed=1)
    ratio, u, v = est.row_draws(seeds, 9, 5)
    for b, seed in enumerate(seeds.tolist()):
        t, ru, rv = ref_draws(seed, 9, 5)
        assert float(ratio[b]) == t and u[b].tolist() == ru and v[b].tolist() == rv
        assert EPS < t <= 1
    # a row draws the same alone, in another batch, or in another order
    alone = est.row_draws(seeds[3:4], 9, 5)
    assert torch.equal(alone[1][0], u[3]) and torch.equal(alone[0][0], ratio[3])
    flipped = est.row_draws(seeds.flip(0), 9, 5)
    assert torch.equal(flipped[1].flip(0), u)
    assert len(set(ratio.tolist())) == 7  # different seeds, different draws


@pytest.mark.parametrize(
    "estimator,complementary",
    [("rldf", False), ("sequential", False), ("all_masking", False), ("random_masking", False),
     ("random_masking", True)],
)
def test_states_targets_weights_match_bruteforce(tokenizer, estimator, complementary):
    batch = random_batch(tokenizer, seed=5)
    rows = batch["rollout_ids"].shape[0]
    batch["mask_seed"] = _seeds(rows, seed=6)
    mask_id = tokenizer.mask_token_id
    prompt_p = 0.4 if estimator == "all_masking" else 0.0
    steps = est.estimator_steps(estimator, batch["sampled_steps"], batch["valid_mask"], batch["mask_seed"], complementary)
    k = steps.shape[1]
    assert k == est.num_states(estimator, batch["sampled_steps"].shape[1], complementary)
    clean_prob = torch.rand(rows, k, GEN, generator=torch.Generator().manual_seed(7))
    seen_targets = seen_prompt_mask = 0
    for j in range(k):
        step = steps[:, j]
        prompt_ids, state = est.estimator_state(
            estimator, rollout_ids=batch["rollout_ids"], commit_step=batch["commit_step"],
            valid_mask=batch["valid_mask"], step=step, prompt_ids=batch["rollout_prompt_ids"],
            prompt_mask=batch["rollout_prompt_mask"], mask_token_id=mask_id, mask_seed=batch["mask_seed"],
            prompt_mask_prob=prompt_p,
        )
        targets, weights = est.estimator_targets(
            estimator, commit_step=batch["commit_step"], valid_mask=batch["valid_mask"], step=step,
            mask_seed=batch["mask_seed"], clean_prob=clean_prob[:, j], clean_threshold=0.5,
        )
        assert (weights is None) == (estimator != "random_masking")
        for b in range(rows):
            if int(step[b]) == INVALID_STEP:
                assert not targets[b].any()
                continue
            ref_prompt, ref_state, ref_targets, ref_weights = ref_state_targets_weights(
                estimator, batch, b, int(step[b]), clean_prob=clean_prob[b, j], c=0.5, prompt_p=prompt_p,
                mask_id=mask_id,
            )
            assert prompt_ids[b].tolist() == ref_prompt, (b, j)
            assert state[b].tolist() == ref_state, (b, j)
            assert targets[b].nonzero().squeeze(1).tolist() == ref_targets, (b, j)
            assert ref_targets, "a live state always has a target"
            seen_targets += len(ref_targets)
            seen_prompt_mask += sum(x == mask_id for x in ref_prompt)
            if weights is not None:
                for i in range(GEN):
                    want = ref_weights.get(i, 0.0)
                    assert float(weights[b, i]) == pytest.approx(want, rel=1e-6), (b, j, i)
    assert seen_targets > 0
    if prompt_p:
        assert seen_prompt_mask > 0


def test_estimator_steps_mark_states_without_targets_as_padding(tokenizer):
    batch = random_batch(tokenizer, seed=9)
    rows = batch["rollout_ids"].shape[0]
    valid = batch["valid_mask"].clone()
    valid[0] = 0  # a row without any valid token
    valid[1] = 0
    valid[1, 0] = 1  # a single valid token: the mask always takes it, the complement never has a target
    seeds = _seeds(rows, seed=10)
    traj = est.estimator_steps("rldf", batch["sampled_steps"], valid, seeds)
    assert traj is batch["sampled_steps"] and est.estimator_steps("sequential", traj, valid, seeds) is traj
    assert est.estimator_steps("all_masking", traj, valid, seeds)[:, 0].tolist() == [INVALID_STEP] + [0] * (rows - 1)
    single = est.estimator_steps("random_masking", traj, valid, seeds)
    assert single.shape == (rows, 1) and single[:, 0].tolist() == [INVALID_STEP] + [0] * (rows - 1)
    pair = est.estimator_steps("random_masking", traj, valid, seeds, complementary=True)
    assert pair.shape == (rows, 2)
    for b in range(rows):
        valid_b = valid[b].nonzero().squeeze(1).tolist()
        masked, _ = ref_random_mask(int(seeds[b]), valid_b, GEN)
        want = [0 if masked & set(valid_b) else INVALID_STEP, 1 if set(valid_b) - masked else INVALID_STEP]
        assert pair[b].tolist() == want
    assert pair[1].tolist() == [0, INVALID_STEP]
    with pytest.raises(ValueError, match="policy_estimator"):
        est.estimator_steps("nope", traj, valid, seeds)


# --------------------------------------------------------------------------------------------------
# 2. random-masking weights are inverse inclusion probabilities
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.01, 0.3, 0.9])
@pytest.mark.parametrize("L", [1, 3, 8])
def test_inclusion_probability_matches_frequency(t, L):
    draws, gen = 20000, 10
    g = torch.Generator().manual_seed(L * 100 + int(t * 100))
    u = torch.rand(draws, gen, dtype=torch.float64, generator=g)
    valid = torch.zeros(draws, gen, dtype=torch.bool)
    valid[:, 2 : 2 + L] = True
    masked = est.random_completion_mask(u, torch.full((draws,), t, dtype=torch.float64), valid)
    assert (masked & valid).any(1).all()  # at least one valid token, always
    freq = masked[:, 2 : 2 + L].double().mean(0)
    p = float(est.inclusion_probability(torch.tensor([t]), torch.tensor([L])))
    assert p == pytest.approx(1.0 if L == 1 else t + (1 - t) ** L / L)
    sigma = math.sqrt(p * (1 - p) / draws)
    assert torch.allclose(freq, torch.full_like(freq, p), atol=5 * sigma + 1e-3)
    # outside the completion the plain rule u < t
    outside = masked[:, 2 + L :].double().mean()
    if L < gen - 2:
        assert float(outside) == pytest.approx(t, abs=5 * math.sqrt(t * (1 - t) / draws / (gen - 2 - L)) + 1e-3)


@pytest.mark.parametrize("complementary", [False, True])
def test_weighted_targets_are_unbiased_for_the_full_sum(complementary):
    """E over seeds of Σ_{targets} w_i c_i = Σ_{valid} c_i (each state; and the pair's sum = 2 Σ c)."""
    draws, gen = 40000, 8
    seeds = _seeds(draws, seed=3)
    valid = torch.zeros(draws, gen, dtype=torch.long)
    valid[:, :5] = 1
    c = torch.tensor([0.3, -1.0, 2.0, 0.5, 1.2, 9.0, 9.0, 9.0])  # invalid positions must never count
    total = c[:5].sum()
    for step_id in ([0, 1] if complementary else [0]):
        targets, weights = est.estimator_targets(
            "random_masking", commit_step=torch.zeros(draws, gen, dtype=torch.long), valid_mask=valid,
            step=torch.full((draws,), step_id), mask_seed=seeds,
        )
        assert not targets[:, 5:].any()
        estimate = (weights * targets * c).sum(1).double()
        mean, sem = float(estimate.mean()), float(estimate.std() / math.sqrt(draws))
        assert mean == pytest.approx(float(total), abs=5 * sem), (step_id, mean, sem)


# --------------------------------------------------------------------------------------------------
# 3. the trainer's loss and gradients against a brute-force loop
# --------------------------------------------------------------------------------------------------
def _tiny_model(tokenizer, head_scale=30.0):
    model = build_tiny_llada(
        mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=32, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, seed=3,
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


@pytest.fixture(scope="module")
def trainer(tokenizer, tmp_path_factory):
    args = RLDFConfig(
        output_dir=str(tmp_path_factory.mktemp("estimators")), use_cpu=True, report_to="none", save_strategy="no",
        max_completion_length=GEN, block_length=4, per_device_train_batch_size=4, gradient_accumulation_steps=ACCUM,
        num_generations=4, num_sampled_timesteps=3, drop_zero_variance_groups=False, beta=0.0, seed=0,
    )
    trainer = RLDFTrainer(
        model=_tiny_model(tokenizer), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+2=", "3*4=", "5-1=", "9+9="]}), processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = ACCUM
    return trainer


def _configure(trainer, estimator, *, norm, beta, complementary=False, prompt_p=0.0, c=0.2):
    trainer.args.policy_estimator = estimator
    trainer.args.complementary_masking = complementary
    trainer.args.prompt_mask_prob = prompt_p
    trainer.args.loss_normalization = norm
    trainer.args.clean_target_threshold = c
    trainer.beta = beta
    trainer.epsilon_low, trainer.epsilon_high = EPS_LOW, EPS_HIGH


def ref_state_logps(model, batch, steps, estimator, prompt_p):
    """{(b, j): (log π(o_i | state) for i < G, targets, weights)} by hand, one forward per live state."""
    mask_id = model.config.mask_token_id
    P = batch["rollout_prompt_ids"].shape[1]
    out = {}
    for b in range(steps.shape[0]):
        for j, step in enumerate(steps[b].tolist()):
            if step == INVALID_STEP:
                continue
            prompt, state, _, _ = ref_state_targets_weights(estimator, batch, b, step, prompt_p=prompt_p, mask_id=mask_id)
            ids = torch.tensor([prompt + state])
            attention = torch.cat([batch["rollout_prompt_mask"][b], torch.ones(GEN, dtype=torch.long)]).unsqueeze(0)
            logp = model(input_ids=ids, attention_mask=attention).logits[0].float().log_softmax(-1)
            out[b, j] = torch.stack([logp[P + i, batch["rollout_ids"][b, i]] for i in range(GEN)])
    return out


def ref_loss(batch, steps, current, estimator, *, ppo, beta, norm, prompt_p, c, train=True):
    terms, weights_of = {}, {}
    for (b, j), logps in current.items():
        clean = batch["old_per_token_logps"][b, j].exp() if ppo else logps.detach().exp()
        _, _, targets, w = ref_state_targets_weights(
            estimator, batch, b, int(steps[b, j]), clean_prob=clean, c=c, prompt_p=prompt_p, mask_id=-1
        )
        A = float(batch["advantages"][b])
        row_terms, row_weights = [], []
        for i in targets:
            cur = logps[i]
            if ppo:
                ratio = torch.exp(cur - float(batch["old_per_token_logps"][b, j, i]))
                term = -torch.minimum(ratio * A, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * A)
            else:
                term = -A * cur
            if beta:
                delta = float(batch["ref_per_token_logps"][b, j, i]) - cur
                term = term + beta * (torch.exp(delta) - delta - 1)
            row_terms.append(term)
            row_weights.append(w.get(i, 1.0))
        terms[b, j], weights_of[b, j] = row_terms, row_weights
    zero = torch.zeros(())
    if norm == "token":
        num = sum((w * x for key in terms for x, w in zip(terms[key], weights_of[key])), zero)
        den = sum(sum(weights_of[key]) for key in terms)
        return num / den if den else zero
    rows = steps.shape[0]
    row_losses = []
    for b in range(rows):
        per_state = [
            sum(w * x for x, w in zip(terms[key], weights_of[key])) / sum(weights_of[key]) if terms[key] else zero
            for key in terms if key[0] == b
        ]
        row_losses.append(sum(per_state) / len(per_state) if per_state else zero)
    return sum(row_losses) / rows / (ACCUM if train else 1)


def _backward(trainer, inputs):
    params = trainable_params(trainer.model)
    for p in params:
        p.grad = None
    loss = trainer._compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach(), grads


CASES = [
    ("sequential", {}),
    ("all_masking", {}),
    ("all_masking", {"prompt_p": 0.3}),
    ("random_masking", {}),
    ("random_masking", {"complementary": True}),
]


@pytest.mark.parametrize("norm", ["token", "sample"])
@pytest.mark.parametrize("objective", ["reinforce", "ppo_kl"])
@pytest.mark.parametrize("estimator,options", CASES)
def test_trainer_loss_and_grads_match_bruteforce(trainer, tokenizer, estimator, options, objective, norm):
    ppo = objective == "ppo_kl"
    beta = 0.05 if ppo else 0.0
    batch = random_batch(tokenizer, seed=13)
    rows = batch["rollout_ids"].shape[0]
    batch["mask_seed"] = _seeds(rows, seed=14)
    complementary, prompt_p = options.get("complementary", False), options.get("prompt_p", 0.0)
    batch["sampled_steps"] = est.estimator_steps(
        estimator, batch["sampled_steps"], batch["valid_mask"], batch["mask_seed"], complementary
    )
    steps = batch["sampled_steps"]
    model = trainer.model
    current = ref_state_logps(model, batch, steps, estimator, prompt_p)
    g = torch.Generator().manual_seed(15)
    for key in (["old_per_token_logps"] if ppo else []) + (["ref_per_token_logps"] if beta else []):
        noisy = torch.zeros(rows, steps.shape[1], GEN)
        for (b, j), logps in current.items():
            noisy[b, j] = (logps.detach() + 0.3 * torch.randn(GEN, generator=g)).clamp_max(-1e-4)
        batch[key] = noisy
    expected = ref_loss(batch, steps, current, estimator, ppo=ppo, beta=beta, norm=norm, prompt_p=prompt_p, c=0.2)
    expected_grads = torch.autograd.grad(expected, trainable_params(model), allow_unused=True)
    expected_grads = [torch.zeros_like(p) if e is None else e for e, p in zip(expected_grads, trainable_params(model))]

    _configure(trainer, estimator, norm=norm, beta=beta, complementary=complementary, prompt_p=prompt_p)
    inputs = prepare_batch(trainer, batch, (*TRAJECTORY, "sampled_steps", "mask_seed"))
    assert ("target_weight" in inputs) == (estimator == "random_masking")
    loss, grads = _backward(trainer, inputs)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    assert any(e.abs().max() > 1e-4 for e in expected_grads)
    for a, e in zip(grads, expected_grads):
        torch.testing.assert_close(a, e, atol=2e-6, rtol=1e-4)
    # the scoring pass (old / ref) scores the same states as the loss, at every position a term can read
    with torch.no_grad():
        scored = trainer.loss.score_states(model, inputs, batch_size=2)
    for (b, j), logps in current.items():
        read = inputs["target_mask"][b, j] if estimator != "rldf" else (
            (inputs["commit_step"][b] >= inputs["sampled_steps"][b, j]) & inputs["valid_mask"][b].bool()
        )
        assert read.any()
        torch.testing.assert_close(scored[b, j][read], logps.detach()[read], atol=1e-5, rtol=1e-5)
        assert (scored[b, j][~read] == 0).all()
    utility = trainer._metrics["train"]["rldf/token_utility"][-1]
    if estimator == "all_masking":
        assert utility == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------------
# 4. config, and masks that stay fixed across iterations and accumulation steps
# --------------------------------------------------------------------------------------------------
def _args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"), max_completion_length=8, block_length=4, per_device_train_batch_size=4,
        num_generations=4, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-2, temperature=1.0,
        num_sampled_timesteps=2, beta=0.01, save_strategy="no", use_cpu=True, drop_zero_variance_groups=False,
        seed=0,
    )
    values.update(overrides)
    return RLDFConfig(**values)


def test_config_validation(tmp_path):
    assert _args(tmp_path).policy_estimator == "rldf"
    assert _args(tmp_path).prompt_mask_prob == 0.0 and not _args(tmp_path).complementary_masking
    with pytest.raises(ValueError, match="policy_estimator"):
        _args(tmp_path, policy_estimator="elbo")
    with pytest.raises(ValueError, match="prompt_mask_prob"):
        _args(tmp_path, policy_estimator="all_masking", prompt_mask_prob=1.0)
    with pytest.raises(ValueError, match="all_masking"):
        _args(tmp_path, policy_estimator="random_masking", prompt_mask_prob=0.15)
    with pytest.raises(ValueError, match="random_masking"):
        _args(tmp_path, policy_estimator="all_masking", complementary_masking=True)
    _args(tmp_path, policy_estimator="all_masking", prompt_mask_prob=0.15)
    _args(tmp_path, policy_estimator="random_masking", complementary_masking=True)


def test_subclass_with_own_states_refuses_masking_estimators(tmp_path):
    from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer

    tok = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tok), mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id)
    args = DPPOMaskConfig(
        output_dir=str(tmp_path / "dppo"), max_completion_length=8, block_length=4, per_device_train_batch_size=4,
        num_generations=4, report_to="none", use_cpu=True, num_sampled_timesteps=2, divergence_top_k=4,
        policy_estimator="random_masking",
    )
    with pytest.raises(ValueError, match="policy_estimator"):
        DPPOMaskTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                        processing_class=tok)


@pytest.mark.parametrize(
    "options",
    [dict(policy_estimator="random_masking", complementary_masking=True),
     dict(policy_estimator="all_masking", prompt_mask_prob=0.5)],
)
def test_masks_are_fixed_across_iterations_and_accumulation(tmp_path, options):
    """train() with num_iterations = 2 and 2 accumulation steps: the old-policy pass, the reference pass and all
    four loss passes of a generation batch build identical states for a row; at the first iteration (no optimizer
    step yet) every PPO ratio is 1."""
    tok = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tok), mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id)
    args = _args(tmp_path, num_iterations=2, gradient_accumulation_steps=2, max_steps=2, **options)
    trainer = RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                          processing_class=tok)
    assert trainer.args.steps_per_generation == 2
    states, ratios = {}, []
    original_state_inputs = trainer.loss.state_inputs
    original_terms = rldf_loss_module.policy_token_terms

    def recording_state_inputs(batch, rows, j, mask_token_id):
        prompt_ids, prompt_mask, state = original_state_inputs(batch, rows, j, mask_token_id)
        for n, row in enumerate(rows.tolist()):
            key = (int(batch["mask_seed"][row]), int(batch["sampled_steps"][row, j]))
            states.setdefault(key, []).append((prompt_ids[n].clone(), state[n].clone()))
        return prompt_ids, prompt_mask, state

    def recording_terms(logps, advantages, old_logps=None, *a, **kw):
        terms, ratio = original_terms(logps, advantages, old_logps, *a, **kw)
        ratios.append((trainer._step, None if ratio is None else ratio.detach().clone()))
        return terms, ratio

    with mock.patch.object(trainer.loss, "state_inputs", recording_state_inputs), \
            mock.patch.object(rldf_loss_module, "policy_token_terms", recording_terms):
        trainer.train()
    assert states
    num_states = 2 if options["policy_estimator"] == "random_masking" else 1
    assert len({seed for seed, _ in states}) == 8  # one generation batch of 8 rows, 8 different seeds
    assert len(states) >= 8
    for key, seen in states.items():
        # old-policy pass + reference pass + one loss pass per iteration (2)
        assert len(seen) == 4, (key, len(seen))
        for prompt_ids, state in seen[1:]:
            assert torch.equal(prompt_ids, seen[0][0]) and torch.equal(state, seen[0][1]), key
    assert sum(1 for _, step in states if step == 1) == (len(states) - 8 if num_states == 2 else 0)
    first_iteration = [r for step, r in ratios if step < 2]
    later = [r for step, r in ratios if step >= 2]
    assert first_iteration and later and all(r is not None for r in first_iteration)
    for r in first_iteration:
        torch.testing.assert_close(r, torch.ones_like(r), atol=1e-5, rtol=0)
    assert any((r - 1).abs().max() > 1e-4 for r in later)  # the optimizer moved: iteration 2 is off-policy
    if options["policy_estimator"] == "all_masking":
        assert any((p == tok.mask_token_id).any() for seen in states.values() for p, _ in seen)


def test_mask_seeds_leave_the_rollout_stream_untouched(tmp_path):
    """Same seed, different estimators: the first rollout is identical (the mask seeds come from their own
    generator), so the benchmark's estimators start from the same completions."""
    tok = make_char_tokenizer()
    batches = {}
    for estimator in ("rldf", "random_masking"):
        model = build_tiny_llada(vocab_size=len(tok), mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id)
        trainer = RLDFTrainer(model=model, reward_funcs=length_reward, args=_args(tmp_path, policy_estimator=estimator),
                              train_dataset=addition_dataset(), processing_class=tok)
        prompts = [tok("1+2=")["input_ids"], tok("7+1=")["input_ids"]]
        trainer._generate_single_turn(prompts, None, None, 1)
        batches[estimator] = dict(trainer._rollout)
    a, b = batches["rldf"], batches["random_masking"]
    assert torch.equal(a["rollout_ids"], b["rollout_ids"]) and torch.equal(a["commit_step"], b["commit_step"])
    assert torch.equal(a["mask_seed"], b["mask_seed"]) and a["mask_seed"][0] != a["mask_seed"][1]
    assert a["sampled_steps"].shape == (2, 2) and b["sampled_steps"].shape == (2, 1)
