"""Tests for the RLDF loss (SPEC §2): timestep sampling, noisy states, clean targets, step loss.

The loss of a real (tiny) ``RLDFTrainer`` and its gradients are compared with a brute-force reference
written plainly below from SPEC §2: Python loops over completions and sampled steps, ``o_t`` built by
hand, a plain full forward of ``q ⊕ o_t``, target sets built with Python sets, and the aggregation of
Eq. 10 ("sample") or over all target tokens ("token"). Random trajectories enter the trainer where TRL's
generation and scoring would hand them over (``_generate_and_score_completions``), and the gradient is read
after the trainer's own backward(s), as in ``training_step``. The timestep sampler is checked against the
exact without-replacement (Plackett–Luce) probabilities of ``softmax(P / τ)``, and ``noisy_state`` against
the canvases the real sampler saw.
"""

from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from dllm_trl import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.generation import NEVER_COMMITTED
from dllm_trl.losses import RLDFLoss
from dllm_trl.losses.rldf_terms import INVALID_STEP, noisy_state, sample_timesteps, step_uncertainty
from tests.tiny_models import build_tiny_dream, build_tiny_llada
from dllm_trl.toy.tokenizer import build_toy_tokenizer
from dllm_trl.trainers import RLDFConfig, RLDFTrainer

VOCAB = 32
GEN, BLOCK, K = 8, 4, 3
ACCUM = 2  # gradient accumulation steps = steps per generation
EPS_LOW, EPS_HIGH = 0.2, 0.28
TRAJECTORY = ("rollout_prompt_ids", "rollout_prompt_mask", "rollout_ids", "commit_step", "valid_mask", "sampled_steps")


# --------------------------------------------------------------------------------------------------
# tiny models and trainers
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer()


def _tiny_model(family: str, tokenizer, head_scale: float = 30.0):
    kwargs = dict(
        mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=VOCAB,
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, seed=3,
    )
    model = build_tiny_llada(**kwargs) if family == "llada" else build_tiny_dream(num_key_value_heads=1, **kwargs)
    with torch.no_grad():  # a sharp head, so that probabilities spread over (0, 1) and thresholds matter
        model.lm_head.weight.mul_(head_scale)
    return model


def _build_trainer(family, tokenizer, tmp_path_factory):
    return loss_test_trainer(_tiny_model(family, tokenizer), tokenizer, str(tmp_path_factory.mktemp(f"rldf-{family}")))


def loss_test_trainer(model, tokenizer, output_dir):
    """The trainer these tests drive by hand (G = 8, blocks of 4, k = 3, two accumulation steps, β = 0)."""
    args = RLDFConfig(
        output_dir=output_dir,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        max_completion_length=GEN,
        block_length=BLOCK,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUM,
        num_generations=4,
        num_sampled_timesteps=K,
        drop_zero_variance_groups=False,
        beta=0.0,
        seed=0,
    )
    assert args.steps_per_generation == ACCUM
    trainer = RLDFTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        loss=RLDFLoss(args),  # the oracles' loss, also on an MoE model (whose family's default adds routing metrics)
        train_dataset=Dataset.from_dict({"prompt": ["1+2=", "3*4=", "5-1=", "9+9="]}),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = ACCUM  # set by the training loop
    return trainer


@pytest.fixture(scope="module")
def llada_trainer(tokenizer, tmp_path_factory):
    return _build_trainer("llada", tokenizer, tmp_path_factory)


@pytest.fixture(scope="module")
def dream_trainer(tokenizer, tmp_path_factory):
    return _build_trainer("dream", tokenizer, tmp_path_factory)


@pytest.fixture(params=["llada", "dream"])
def trainer(request):
    """Both model shapes: LLaDA (no logit shift) and Dream (logits for position i come from i − 1)."""
    return request.getfixturevalue(f"{request.param}_trainer")


def _configure(trainer, *, norm="token", c=0.2, beta=0.0, backward_mode="per_step", targets_from_loss=True):
    trainer.args.backward_mode = backward_mode
    trainer.defer_clean_targets = targets_from_loss
    trainer.args.loss_normalization = norm
    trainer.args.clean_target_threshold = c
    trainer.beta = beta
    trainer.epsilon_low, trainer.epsilon_high = EPS_LOW, EPS_HIGH


def prepare_batch(trainer, batch, trajectory_keys=TRAJECTORY):
    """The batch as the trainer's own ``_generate_and_score_completions`` finishes it (target sets, counts, …),
    with TRL's generation and scoring replaced by the given trajectory, advantages and old / ref log-probs."""
    trajectory = {key: batch[key] for key in trajectory_keys}
    scored = {key: value for key, value in batch.items() if key not in trajectory}
    trainer._rollout = trajectory
    with mock.patch.object(GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: dict(scored)):
        return trainer._generate_and_score_completions([])


def trainable_params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _grads(loss, params):
    if not loss.requires_grad:
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _backward(trainer, inputs):
    """``_compute_loss`` then the trainer's backward, as ``training_step`` does; returns (loss, gradients)."""
    params = trainable_params(trainer.model)
    for p in params:
        p.grad = None
    loss = trainer._compute_loss(trainer.model, inputs)
    if torch.is_grad_enabled():
        trainer.accelerator.backward(loss)
        if trainer._pending_token_norm:  # what training_step does after the last micro-batch's backward
            loss = trainer._finish_pending_normalization(trainer.model, loss.detach())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach(), grads


def _trainer_loss_and_grads(trainer, batch, **config):
    _configure(trainer, **config)
    return _backward(trainer, prepare_batch(trainer, batch))


def _assert_grads_close(actual, expected, atol=2e-6, rtol=1e-4):
    assert any(g.abs().max() > 1e-4 for g in expected), "the reference gradient vanishes: the check is void"
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------------
# random trajectories
# --------------------------------------------------------------------------------------------------
def _block_commit_order(gen: torch.Generator, positions: list[int], first_step: int) -> tuple[dict[int, int], int]:
    """A random commit order of one block: a random permutation cut into 2+ steps (several tokens per step)."""
    order = [positions[i] for i in torch.randperm(len(positions), generator=gen).tolist()]
    n_steps = int(torch.randint(2, len(positions), (1,), generator=gen))
    cuts = sorted(torch.randperm(len(positions) - 1, generator=gen)[: n_steps - 1].add(1).tolist())
    steps = {}
    for s, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, len(positions)])):
        for p in order[lo:hi]:
            steps[p] = first_step + s
    return steps, first_step + n_steps


def random_batch(tokenizer, seed: int = 0):
    """Six completions with random commit orders (G = 8, two blocks of 4):

    row 0: no EOS, k steps · row 1: EOS at 2, block 1 decoded after it (invalid), 2 steps + padding ·
    row 2: every sampled step is padding · row 3: EOS at 3, block 1 never committed (EOS-filled), A = 0 ·
    row 4: no EOS, k steps, A < 0 · row 5: EOS at 6, k steps. Prompts of lengths 4, 2, 3, 1, 4, 2, left-padded.
    """
    gen = torch.Generator().manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    content = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    prompt_lengths = [4, 2, 3, 1, 4, 2]
    eos_at = [None, 2, None, 3, None, 6]
    decoded_blocks = [2, 2, 2, 1, 2, 2]
    n_sampled = [K, 2, 0, 2, K, K]
    advantages = torch.tensor([1.3, -0.9, 0.6, 0.0, -0.4, 0.8])
    P = max(prompt_lengths)
    rows = len(prompt_lengths)

    prompt_ids = torch.full((rows, P), pad, dtype=torch.long)
    prompt_mask = torch.zeros(rows, P, dtype=torch.long)
    rollout_ids = torch.full((rows, GEN), eos, dtype=torch.long)
    commit_step = torch.full((rows, GEN), NEVER_COMMITTED, dtype=torch.long)
    valid_mask = torch.zeros(rows, GEN, dtype=torch.long)
    sampled = torch.full((rows, K), INVALID_STEP, dtype=torch.long)
    for b in range(rows):
        pick = lambda n: [content[i] for i in torch.randint(len(content), (n,), generator=gen).tolist()]  # noqa: E731
        prompt_ids[b, P - prompt_lengths[b] :] = torch.tensor(pick(prompt_lengths[b]))
        prompt_mask[b, P - prompt_lengths[b] :] = 1
        step = 0
        for block in range(decoded_blocks[b]):
            positions = list(range(block * BLOCK, (block + 1) * BLOCK))
            steps, step = _block_commit_order(gen, positions, step)
            for p, s in steps.items():
                commit_step[b, p] = s
            rollout_ids[b, positions] = torch.tensor(pick(BLOCK))
        last = GEN - 1 if eos_at[b] is None else eos_at[b]
        if eos_at[b] is not None:
            rollout_ids[b, eos_at[b]] = eos
        valid_mask[b, : last + 1] = 1
        # Like the sampler's selection: only steps that committed at least one valid token.
        candidates = sorted({int(commit_step[b, i]) for i in range(last + 1)})
        chosen = [candidates[i] for i in torch.randperm(len(candidates), generator=gen)[: n_sampled[b]].tolist()]
        sampled[b, : len(chosen)] = torch.tensor(sorted(chosen), dtype=torch.long)
    return {
        "rollout_prompt_ids": prompt_ids,
        "rollout_prompt_mask": prompt_mask,
        "rollout_ids": rollout_ids,
        "commit_step": commit_step,
        "valid_mask": valid_mask,
        "sampled_steps": sampled,
        "advantages": advantages,
    }


def add_old_and_ref(batch, current: dict, seed: int, ppo: bool, beta: bool, noise: float = 0.3):
    """``old_per_token_logps`` / ``ref_per_token_logps`` (B, k, G): the current log-probs plus noise."""
    gen = torch.Generator().manual_seed(seed)
    rows, k = batch["sampled_steps"].shape

    def perturbed():
        out = torch.zeros(rows, k, GEN)
        for (b, j), logps in current.items():
            noisy = logps.detach() + noise * torch.randn(GEN, generator=gen)
            out[b, j] = noisy.clamp_max(-1e-4)
        return out

    batch = dict(batch)
    if ppo:
        batch["old_per_token_logps"] = perturbed()
    if beta:
        batch["ref_per_token_logps"] = perturbed()
    return batch


# --------------------------------------------------------------------------------------------------
# brute-force reference (SPEC §2.2–2.3)
# --------------------------------------------------------------------------------------------------
def reference_state_logps(model, batch) -> dict:
    """{(b, j): [log π(o_i | q, o_t) for i < G]} for every sampled (completion, step): ``o_t`` built by hand, then
    a plain full forward of ``q ⊕ o_t`` (all (b, j) stacked in one batch: rows do not interact)."""
    mask_id = model.config.mask_token_id
    shift = 1 if model.config.diffusion_logit_shift else 0
    P = batch["rollout_prompt_ids"].shape[1]
    keys, input_ids, attention_mask = [], [], []
    for b in range(batch["rollout_ids"].shape[0]):
        ids = batch["rollout_ids"][b].tolist()
        steps = batch["commit_step"][b].tolist()
        for j, t in enumerate(batch["sampled_steps"][b].tolist()):
            if t == INVALID_STEP:
                continue
            o_t = [mask_id if steps[i] >= t else ids[i] for i in range(GEN)]
            keys.append((b, j))
            input_ids.append(torch.cat([batch["rollout_prompt_ids"][b], torch.tensor(o_t)]))
            attention_mask.append(torch.cat([batch["rollout_prompt_mask"][b], torch.ones(GEN, dtype=torch.long)]))
    if not keys:
        return {}
    logits = model(input_ids=torch.stack(input_ids), attention_mask=torch.stack(attention_mask)).logits
    logp = logits.float().log_softmax(-1)
    out = {}
    for n, (b, j) in enumerate(keys):
        ids = batch["rollout_ids"][b].tolist()
        out[b, j] = torch.stack([logp[n, P + i - shift, ids[i]] for i in range(GEN)])
    return out


def reference_state_entropies(model, batch) -> dict:
    """{(b, j): [entropy of π(· | q, o_t) at completion position i]}, from the same plain forward as the log-probs."""
    mask_id = model.config.mask_token_id
    shift = 1 if model.config.diffusion_logit_shift else 0
    P = batch["rollout_prompt_ids"].shape[1]
    out = {}
    for b in range(batch["rollout_ids"].shape[0]):
        for j, t in enumerate(batch["sampled_steps"][b].tolist()):
            if t == INVALID_STEP:
                continue
            o_t = torch.where(batch["commit_step"][b] >= t, mask_id, batch["rollout_ids"][b])
            ids = torch.cat([batch["rollout_prompt_ids"][b], o_t]).unsqueeze(0)
            mask = torch.cat([batch["rollout_prompt_mask"][b], torch.ones(GEN, dtype=torch.long)]).unsqueeze(0)
            logp = model(input_ids=ids, attention_mask=mask).logits[0, P - shift : P - shift + GEN].float().log_softmax(-1)
            out[b, j] = -(logp.exp() * logp).sum(-1)
    return out


def reference_targets(batch, current, c: float, ppo: bool) -> dict:
    """{(b, j): sorted Ô_t} with Ô_t = (I_t ∪ {i : step > t, p_i ≥ c}) ∩ valid (p: detached current / old)."""
    targets = {}
    for (b, j), logps in current.items():
        t = int(batch["sampled_steps"][b, j])
        steps = batch["commit_step"][b].tolist()
        valid = {i for i in range(GEN) if batch["valid_mask"][b, i]}
        source = batch["old_per_token_logps"][b, j] if ppo else logps.detach()
        committed_now = {i for i in range(GEN) if steps[i] == t}
        predicted = {i for i in range(GEN) if steps[i] > t and math.exp(float(source[i])) >= c}
        targets[b, j] = sorted((committed_now | predicted) & valid)
    return targets


def reference_loss(batch, current, targets, *, ppo: bool, beta: float, norm: str, train: bool = True,
                   delta: float | None = None, bias_kl: bool = False, entropy_coef: float = 0.0, entropies=None):
    """Eq. 10 ("sample") or one mean over all target tokens ("token").

    In training a micro-batch is one of ``ACCUM`` accumulated ones: "sample" divides by ``ACCUM`` (the mean over
    completions spans the micro-batches); "token" divides by the target count of the generation batch, which
    here is this batch (``steps_per_generation = ACCUM``). TRL's terms, as TRL writes them: ``delta`` caps the
    unclipped ratio, ``bias_kl`` weights the k3 KL by π_θ/π_old (π_old = π_θ detached on-policy), ``entropy_coef``
    subtracts that multiple of the token's entropy (``entropies`` as :func:`reference_state_entropies` gives them).
    """
    terms_per_step = {}
    for (b, j), logps in current.items():
        A = float(batch["advantages"][b])
        terms = []
        for i in targets[b, j]:
            cur = logps[i]
            old = float(batch["old_per_token_logps"][b, j, i]) if ppo else cur.detach()
            ratio = torch.exp(cur - old)
            if ppo:
                unclipped = ratio if delta is None else ratio.clamp(max=delta)
                term = -torch.minimum(unclipped * A, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * A)
            else:
                term = -A * cur
            if beta:
                diff = float(batch["ref_per_token_logps"][b, j, i]) - cur
                kl = torch.exp(diff) - diff - 1
                term = term + beta * (kl * ratio if bias_kl else kl)
            if entropy_coef:
                term = term - entropy_coef * entropies[b, j][i]
            terms.append(term)
        terms_per_step[b, j] = terms

    zero = torch.zeros(())
    rows = batch["rollout_ids"].shape[0]
    if norm == "token":
        all_terms = [term for terms in terms_per_step.values() for term in terms]
        return sum(all_terms) / len(all_terms) if all_terms else zero
    row_losses = []
    for b in range(rows):
        step_losses = [
            sum(terms) / len(terms) if terms else zero for (bb, _), terms in terms_per_step.items() if bb == b
        ]
        row_losses.append(sum(step_losses) / len(step_losses) if step_losses else zero)
    return sum(row_losses) / rows / (ACCUM if train else 1)


def _midpoint_threshold(batch, current, ppo: bool) -> float:
    """A threshold ``c`` between two well-separated probabilities of still-masked valid tokens (near their median)."""
    probs = []
    for (b, j), logps in current.items():
        t = int(batch["sampled_steps"][b, j])
        source = batch["old_per_token_logps"][b, j] if ppo else logps.detach()
        for i in range(GEN):
            if batch["commit_step"][b, i] > t and batch["valid_mask"][b, i]:
                probs.append(math.exp(float(source[i])))
    probs.sort()
    gaps = [
        (abs(i - len(probs) / 2), (lo + hi) / 2)
        for i, (lo, hi) in enumerate(zip(probs, probs[1:]))
        if hi - lo > 1e-4
    ]
    return min(gaps)[1]


def _assert_target_mask(inputs, targets):
    """The trainer's Ô_t (B, k, G) equals the reference sets, and is empty for padding steps."""
    mask = inputs["target_mask"]
    for b in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            assert mask[b, j].nonzero().squeeze(1).tolist() == targets.get((b, j), []), (b, j)


# --------------------------------------------------------------------------------------------------
# 1. loss and gradients against the brute-force reference
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("targets_from_loss", [True, False])
@pytest.mark.parametrize("backward_mode", ["per_step", "per_micro_batch"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("norm", ["token", "sample"])
@pytest.mark.parametrize("objective", ["reinforce", "ppo"])
def test_loss_and_grads_match_bruteforce(trainer, tokenizer, objective, norm, beta, backward_mode, targets_from_loss):
    """Loss and gradients equal the brute-force reference, with one backward per sampled step or one in all, and
    (REINFORCE) with the clean targets read from the loss forward itself or from a separate π_old pass."""
    ppo = objective == "ppo"
    model = trainer.model
    batch = random_batch(tokenizer, seed=11)
    current = reference_state_logps(model, batch)
    batch = add_old_and_ref(batch, current, seed=12, ppo=ppo, beta=beta > 0)
    c = _midpoint_threshold(batch, current, ppo)
    targets = reference_targets(batch, current, c, ppo)
    # The threshold splits the still-masked tokens: some join Ô_t, some do not.
    committed_now = sum(
        int(((batch["commit_step"][b] == batch["sampled_steps"][b, j]) & batch["valid_mask"][b].bool()).sum())
        for b, j in targets
    )
    assert sum(len(v) for v in targets.values()) > committed_now
    expected = reference_loss(batch, current, targets, ppo=ppo, beta=beta, norm=norm)
    expected_grads = _grads(expected, trainable_params(model))

    _configure(trainer, norm=norm, c=c, beta=beta, backward_mode=backward_mode, targets_from_loss=targets_from_loss)
    inputs = prepare_batch(trainer, batch)
    assert ("targets_pending" in inputs) == (targets_from_loss and not ppo)
    if "targets_pending" not in inputs:
        _assert_target_mask(inputs, targets)
    loss, grads = _backward(trainer, inputs)
    _assert_target_mask(inputs, targets)  # pending targets are written back by the loss forward
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads_close(grads, expected_grads)


@pytest.mark.parametrize("option", ["delta", "bias_kl", "entropy"])
@pytest.mark.parametrize("objective", ["reinforce", "ppo"])
def test_trl_terms_match_bruteforce(trainer, tokenizer, objective, option):
    """GRPOConfig's delta (two-sided clip), use_bias_correction_kl and entropy_coef, as TRL defines them."""
    ppo = objective == "ppo"
    model = trainer.model
    batch = random_batch(tokenizer, seed=61)
    current = reference_state_logps(model, batch)
    batch = add_old_and_ref(batch, current, seed=62, ppo=ppo, beta=True)
    targets = reference_targets(batch, current, 0.2, ppo)
    settings = {"delta": dict(delta=1.1), "bias_kl": dict(bias_kl=True),
                "entropy": dict(entropy_coef=0.3, entropies=reference_state_entropies(model, batch))}[option]
    expected = reference_loss(batch, current, targets, ppo=ppo, beta=0.05, norm="token", **settings)
    expected_grads = _grads(expected, trainable_params(model))
    if option == "delta" and ppo:  # the cap must bind for the check to mean anything
        assert any(math.exp(float(logps[i]) - float(batch["old_per_token_logps"][b, j, i])) > 1.1
                   for (b, j), logps in current.items() for i in targets[b, j])
    _configure(trainer, norm="token", c=0.2, beta=0.05)
    trainer.args.delta = settings.get("delta")
    trainer.args.use_bias_correction_kl = settings.get("bias_kl", False)
    trainer.args.entropy_coef = settings.get("entropy_coef", 0.0)
    try:
        loss, grads = _backward(trainer, prepare_batch(trainer, batch))
    finally:
        trainer.args.delta, trainer.args.use_bias_correction_kl, trainer.args.entropy_coef = None, False, 0.0
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads_close(grads, expected_grads)
    entropies = reference_state_entropies(model, batch)
    logged = trainer._metrics["train"]["entropy"][-1]
    want = sum(float(entropies[b, j][i]) for (b, j), v in targets.items() for i in v) / sum(map(len, targets.values()))
    assert logged == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("objective", ["reinforce", "ppo"])
@pytest.mark.parametrize("c", [0.0, 1.0])
def test_clean_target_threshold_extremes(trainer, tokenizer, c, objective):
    """c = 0: every later valid token is a target; c = 1: only I_t. Also the logged target count and utility."""
    ppo = objective == "ppo"
    model = trainer.model
    batch = random_batch(tokenizer, seed=21)
    current = reference_state_logps(model, batch)
    batch = add_old_and_ref(batch, current, seed=22, ppo=ppo, beta=True)
    targets = reference_targets(batch, current, c, ppo)
    for (b, j), target in targets.items():
        t = int(batch["sampled_steps"][b, j])
        steps, valid = batch["commit_step"][b], batch["valid_mask"][b].bool()
        want = (steps >= t) if c == 0.0 else (steps == t)
        assert target == (want & valid).nonzero().squeeze(1).tolist()
    expected = reference_loss(batch, current, targets, ppo=ppo, beta=0.05, norm="sample")
    expected_grads = _grads(expected, trainable_params(model))

    _configure(trainer, norm="sample", c=c, beta=0.05)
    inputs = prepare_batch(trainer, batch)
    loss, grads = _backward(trainer, inputs)
    _assert_target_mask(inputs, targets)  # on-policy targets are fixed by the loss forward itself
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads_close(grads, expected_grads)
    logged = trainer._metrics["train"]["rldf/target_tokens_per_step"][-1]
    assert logged == pytest.approx(sum(len(v) for v in targets.values()) / len(targets))
    utility = sum(len(v) / int(batch["valid_mask"][b].sum()) for (b, _), v in targets.items()) / len(targets)
    assert trainer._metrics["train"]["rldf/token_utility"][-1] == pytest.approx(utility, rel=1e-5)


@pytest.mark.parametrize("norm", ["token", "sample"])
def test_micro_batches_accumulate_to_the_generation_batch_loss(llada_trainer, tokenizer, norm):
    """The generation batch split into ``ACCUM`` micro-batches (as TRL does): the micro losses and gradients add
    up to the loss of the whole generation batch — "token": every target token of the batch weighs the same;
    "sample": the mean over all completions."""
    trainer = llada_trainer
    batch = random_batch(tokenizer, seed=31)
    current = reference_state_logps(trainer.model, batch)
    batch = add_old_and_ref(batch, current, seed=32, ppo=True, beta=True)
    targets = reference_targets(batch, current, 0.2, ppo=True)
    expected = reference_loss(batch, current, targets, ppo=True, beta=0.05, norm=norm, train=False)
    expected_grads = _grads(expected, trainable_params(trainer.model))

    _configure(trainer, norm=norm, c=0.2, beta=0.05)
    inputs = prepare_batch(trainer, batch)
    rows = batch["advantages"].shape[0]
    total, total_grads = 0.0, None
    for part in torch.arange(rows).chunk(ACCUM):
        micro = {
            key: value[part] if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows else value
            for key, value in inputs.items()
        }
        loss, grads = _backward(trainer, micro)
        total = total + loss
        total_grads = grads if total_grads is None else [a + g for a, g in zip(total_grads, grads)]
    torch.testing.assert_close(total, expected.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads_close(total_grads, expected_grads)


@pytest.mark.parametrize("norm", ["token", "sample"])
def test_eval_loss_has_no_accumulation_factor(llada_trainer, tokenizer, norm):
    trainer = llada_trainer
    batch = random_batch(tokenizer, seed=41)
    current = reference_state_logps(trainer.model, batch)
    batch = add_old_and_ref(batch, current, seed=42, ppo=False, beta=True)
    targets = reference_targets(batch, current, 0.2, ppo=False)
    expected = reference_loss(batch, current, targets, ppo=False, beta=0.05, norm=norm, train=False).detach()

    _configure(trainer, norm=norm, c=0.2, beta=0.05)
    inputs = prepare_batch(trainer, batch)
    train_loss, _ = _backward(trainer, inputs)
    trainer.model.eval()
    try:
        with torch.no_grad():
            eval_loss = trainer._compute_loss(trainer.model, inputs)
    finally:
        trainer.model.train()
    torch.testing.assert_close(eval_loss, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(train_loss * (ACCUM if norm == "sample" else 1), expected, atol=1e-6, rtol=1e-5)


def test_scoring_pass_scores_the_states_of_the_loss(trainer, tokenizer):
    """old = ref = the trainer's own scoring pass (used for π_old / π_ref): ratios are 1 and the k3 KL and its
    gradient vanish, so PPO + KL has exactly the REINFORCE gradient (same Ô_t, since old = current)."""
    batch = random_batch(tokenizer, seed=51)
    with torch.no_grad():
        scored = trainer.loss.score_states(trainer.model, batch, batch_size=2)
    current = reference_state_logps(trainer.model, batch)
    unread = 0
    for (b, j), logps in current.items():
        # Only the positions a term can read are scored (still masked in o_t and valid); the rest stays 0.
        read = (batch["commit_step"][b] >= batch["sampled_steps"][b, j]) & batch["valid_mask"][b].bool()
        torch.testing.assert_close(scored[b, j][read], logps.detach()[read], atol=1e-5, rtol=1e-5)
        assert (scored[b, j][~read] == 0).all()
        unread += int((~read).sum())
    assert unread > 0
    padding = batch["sampled_steps"] == INVALID_STEP
    assert (scored[padding] == 0).all()

    ppo_batch = dict(batch, old_per_token_logps=scored, ref_per_token_logps=scored)
    loss_ppo, grads_ppo = _trainer_loss_and_grads(trainer, ppo_batch, norm="token", c=0.2, beta=0.05)
    loss_rf, grads_rf = _trainer_loss_and_grads(trainer, batch, norm="token", c=0.2, beta=0.0)
    targets = reference_targets(batch, current, 0.2, ppo=False)
    # At ratio 1 each target token contributes −A (and a zero KL).
    expected = -sum(float(batch["advantages"][b]) * len(v) for (b, _), v in targets.items())
    expected /= sum(len(v) for v in targets.values())
    assert float(loss_ppo) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # fp32 sums taken in another order: seen 2.3e-6 apart on one element of 1024 (Dream shapes, AMD EPYC)
    _assert_grads_close(grads_ppo, grads_rf, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_zero_variance_groups_are_dropped(llada_trainer, tokenizer, aggregation):
    """drop_zero_variance_groups: rows of a group whose rewards are all equal keep their shape but get no step —
    read from the rewards as TRL's frac_reward_zero_std is, so a constant 1/3 (whose float32 group mean leaves tiny
    non-zero advantages) is dropped too; under normalize_then_sum every reward function must be constant."""
    trainer = llada_trainer
    batch = random_batch(tokenizer, seed=55)
    batch = {key: torch.cat([value, value[:2]]) for key, value in batch.items()}  # 8 rows: groups 0–3, 4–7
    third = torch.tensor(1 / 3)
    # Group 0: the rewards vary. Group 1: the first function is a constant 1/3 and the second a constant 0.5, except
    # under normalize_then_sum where the second varies (the group keeps a signal).
    second = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    if aggregation == "normalize_then_sum":
        second[4:] = torch.tensor([0.0, 1.0, 0.0, 1.0])  # group 1 keeps a signal from the second function
    rewards = torch.stack([torch.tensor([1.0, 0.0, 0.0, 1.0, *[third] * 4]), second], dim=1)
    group = rewards[4:, 0]
    advantages = (group - group.mean()) / (group.std() + 1e-4)  # what TRL computes: tiny, non-zero
    batch["advantages"] = torch.cat([torch.tensor([0.5, -0.5, -0.5, 0.5]), advantages])
    _configure(trainer, c=0.2)
    trainer.args.drop_zero_variance_groups = True
    trainer.args.multi_objective_aggregation = aggregation
    trainer.reward_weights = torch.ones(2)
    trainer._gathered_rewards = rewards
    try:
        inputs = prepare_batch(trainer, batch)
    finally:
        trainer.args.drop_zero_variance_groups = False
        trainer.args.multi_objective_aggregation = "sum_then_normalize"
        trainer.reward_weights = torch.ones(1)
    assert torch.equal(inputs["sampled_steps"][:4], batch["sampled_steps"][:4])
    dropped = (inputs["sampled_steps"][4:] == INVALID_STEP).all()
    assert bool(dropped) == (aggregation == "sum_then_normalize")
    if aggregation == "sum_then_normalize":
        assert not inputs["target_mask"][4:].any()


def test_zero_variance_is_read_from_the_rewards_not_from_rounded_advantages(llada_trainer):
    """A constant reward of 9/10 in a group of 8: TRL's float32 group mean leaves advantages of −6e-8, which an
    ``advantages == 0`` test misses; the rewards' spread is within rounding of 0, so the group is dropped."""
    trainer = llada_trainer
    rewards = torch.cat([torch.arange(8.0) / 8, torch.full((8,), 0.9)]).unsqueeze(1)
    grouped = rewards.view(2, 8)
    advantages = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    assert (advantages[1] != 0).all()  # the old rule would keep this group
    trainer._gathered_rewards, trainer.num_generations = rewards, 8
    try:
        assert trainer._zero_variance_rows().tolist() == [False] * 8 + [True] * 8
    finally:
        trainer.num_generations = 4


# --------------------------------------------------------------------------------------------------
# 2. degenerate cases
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["token", "sample"])
@pytest.mark.parametrize("objective", ["reinforce", "ppo"])
def test_zero_advantages_give_zero_loss_and_grads(llada_trainer, tokenizer, objective, norm):
    trainer = llada_trainer
    batch = random_batch(tokenizer, seed=61)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    if objective == "ppo":
        current = reference_state_logps(trainer.model, batch)
        batch = add_old_and_ref(batch, current, seed=62, ppo=True, beta=False)
    loss, grads = _trainer_loss_and_grads(trainer, batch, norm=norm, c=0.2, beta=0.0)
    assert torch.isfinite(loss) and float(loss) == 0.0
    for g in grads:
        assert torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("norm", ["token", "sample"])
@pytest.mark.parametrize("objective", ["reinforce", "ppo"])
def test_all_padding_steps_give_zero_loss_that_backpropagates(llada_trainer, tokenizer, objective, norm):
    """A micro-batch whose every group was dropped (all-equal rewards): loss 0, not NaN, and the trainer's
    ``backward`` still runs (zero gradients)."""
    trainer = llada_trainer
    batch = random_batch(tokenizer, seed=71)
    batch["sampled_steps"] = torch.full_like(batch["sampled_steps"], INVALID_STEP)
    if objective == "ppo":
        batch["old_per_token_logps"] = torch.zeros(*batch["sampled_steps"].shape, GEN)
    batch["ref_per_token_logps"] = torch.zeros(*batch["sampled_steps"].shape, GEN)
    _configure(trainer, norm=norm, c=0.2, beta=0.05)
    inputs = prepare_batch(trainer, batch)
    assert not inputs["target_mask"].any()
    loss = trainer._compute_loss(trainer.model, inputs)
    assert torch.isfinite(loss) and float(loss.detach()) == 0.0
    assert loss.requires_grad  # training_step calls backward on it
    params = trainable_params(trainer.model)
    for p in params:
        p.grad = None
    trainer.accelerator.backward(loss)
    for p in params:
        assert p.grad is None or (p.grad == 0).all()


def test_step_with_only_invalid_tokens_contributes_nothing(llada_trainer, tokenizer):
    """Row 1 has EOS at 2 and a decoded block 1: any step of block 1 commits only invalid tokens, and so does
    every later step, so its Ô_t is empty even at c = 0."""
    trainer = llada_trainer
    batch = random_batch(tokenizer, seed=81)
    dead = int(batch["commit_step"][1, BLOCK:].min())
    assert not batch["valid_mask"][1, BLOCK:].any()

    only_dead = dict(batch, sampled_steps=torch.full_like(batch["sampled_steps"], INVALID_STEP))
    only_dead["sampled_steps"][1, 0] = dead
    for norm in ("token", "sample"):
        loss, grads = _trainer_loss_and_grads(trainer, only_dead, norm=norm, c=0.0, beta=0.0)
        assert torch.isfinite(loss) and float(loss) == 0.0
        assert all((g == 0).all() for g in grads)

    # Next to real steps: with token normalisation the dead step changes nothing at all.
    with_dead = dict(batch, sampled_steps=batch["sampled_steps"].clone())
    assert with_dead["sampled_steps"][1, 2] == INVALID_STEP
    with_dead["sampled_steps"][1, 2] = dead
    loss_a, grads_a = _trainer_loss_and_grads(trainer, batch, norm="token", c=0.0)
    loss_b, grads_b = _trainer_loss_and_grads(trainer, with_dead, norm="token", c=0.0)
    torch.testing.assert_close(loss_a, loss_b)
    _assert_grads_close(grads_b, grads_a)
    # With sample normalisation it is a sampled step with zero loss (mean over the row's sampled steps).
    current = reference_state_logps(trainer.model, with_dead)
    targets = reference_targets(with_dead, current, 0.0, ppo=False)
    assert targets[1, 2] == []
    expected = reference_loss(with_dead, current, targets, ppo=False, beta=0.0, norm="sample")
    loss, grads = _trainer_loss_and_grads(trainer, with_dead, norm="sample", c=0.0)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads_close(grads, _grads(expected, trainable_params(trainer.model)))


# --------------------------------------------------------------------------------------------------
# 3. step uncertainty and weighted timestep sampling (SPEC §2.1)
# --------------------------------------------------------------------------------------------------
def test_step_uncertainty_matches_bruteforce():
    gen = torch.Generator().manual_seed(0)
    rows, G, T = 6, 12, 7
    commit_step = torch.randint(0, T, (rows, G), generator=gen)
    commit_step[0, 8:] = NEVER_COMMITTED
    valid_mask = (torch.rand(rows, G, generator=gen) < 0.8).long()
    valid_mask[0, 8:] = 0
    commit_step[1] = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6])
    valid_mask[1] = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1])  # step 2 has only invalid tokens
    commit_prob = torch.rand(rows, G, generator=gen).clamp_min(1e-3)
    P, has_tokens = step_uncertainty(commit_step, commit_prob, valid_mask, T)
    assert P.shape == has_tokens.shape == (rows, T)
    for b in range(rows):
        for t in range(T):
            I_t = [i for i in range(G) if commit_step[b, i] == t and valid_mask[b, i]]
            assert bool(has_tokens[b, t]) == bool(I_t)
            want = -sum(math.log(float(commit_prob[b, i])) for i in I_t) / len(I_t) if I_t else 0.0
            assert float(P[b, t]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert not has_tokens[1, 2] and float(P[1, 2]) == 0.0


def _plackett_luce_set_probs(weights: list[float], k: int) -> dict[tuple, float]:
    """Exact probability of each (sorted) k-subset when drawing k items without replacement ∝ weights."""
    probs = {}
    for ordered in itertools.permutations(range(len(weights)), k):
        p, left = 1.0, 1.0
        for i in ordered:
            p *= weights[i] / left
            left -= weights[i]
        key = tuple(sorted(ordered))
        probs[key] = probs.get(key, 0.0) + p
    return probs


@pytest.mark.parametrize("temperature", [0.7, 2.0, math.inf])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_sample_timesteps_follows_plackett_luce(k, temperature):
    draws = 20000
    P = torch.tensor([0.2, 1.0, 3.0, 1.6, -0.3, 0.9])
    has = torch.tensor([True, True, False, True, True, True])  # step 2 has the largest P but no token
    valid_steps = [0, 1, 3, 4, 5]
    scaled = [0.0 if math.isinf(temperature) else float(P[s]) / temperature for s in valid_steps]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    weights = [w / sum(weights) for w in weights]
    exact = {tuple(valid_steps[i] for i in key): p for key, p in _plackett_luce_set_probs(weights, k).items()}

    gen = torch.Generator().manual_seed(1234)
    out = sample_timesteps(P.expand(draws, -1), has.expand(draws, -1), k, temperature, gen)
    assert out.shape == (draws, k)
    counts = {}
    for row in out.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert set(counts) <= set(exact)  # sorted, no duplicates, never step 2
    for key, p in exact.items():
        sigma = math.sqrt(p * (1 - p) / draws)
        assert counts.get(key, 0) / draws == pytest.approx(p, abs=5 * sigma + 2e-3), key
    for s in valid_steps:  # inclusion frequencies
        p = sum(prob for key, prob in exact.items() if s in key)
        freq = (out == s).any(1).float().mean().item()
        assert freq == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / draws) + 2e-3), s
    if math.isinf(temperature):
        assert all(p == pytest.approx(1 / math.comb(5, k)) for p in exact.values())


def test_sample_timesteps_zero_temperature_is_top_k():
    gen = torch.Generator().manual_seed(5)
    rows, T, k = 50, 9, 4
    P = torch.randn(rows, T, generator=gen)
    has = torch.rand(rows, T, generator=gen) < 0.7
    for temperature in (0.0, 1e-4):
        out = sample_timesteps(P, has, k, temperature, torch.Generator().manual_seed(6))
        for b in range(rows):
            steps = [t for t in range(T) if has[b, t]]
            best = sorted(sorted(steps, key=lambda t: -float(P[b, t]))[:k])
            assert out[b].tolist() == best + [INVALID_STEP] * (k - len(best))


def test_sample_timesteps_rows_never_duplicate_and_short_rows_take_everything():
    gen = torch.Generator().manual_seed(7)
    rows, T, k = 300, 7, 4
    P = torch.randn(rows, T, generator=gen) * 3
    has = torch.rand(rows, T, generator=gen) < torch.rand(rows, 1, generator=gen)  # 0 … 7 steps per row
    has[0] = False
    has[1] = True
    out = sample_timesteps(P, has, k, 1.0, gen)
    short_rows = 0
    for b in range(rows):
        steps = {t for t in range(T) if has[b, t]}
        row = out[b].tolist()
        chosen = [t for t in row if t != INVALID_STEP]
        assert row == chosen + [INVALID_STEP] * (k - len(chosen))  # padding last
        assert chosen == sorted(set(chosen))  # ascending, never a duplicate
        assert set(chosen) <= steps  # never a step without tokens
        assert len(chosen) == min(k, len(steps))
        if len(steps) <= k:
            short_rows += 1
            assert set(chosen) == steps
    assert short_rows > 10 and out[0].tolist() == [INVALID_STEP] * k
    # Fewer decoding steps than k at all.
    out = sample_timesteps(torch.tensor([[0.5, 0.1]]), torch.tensor([[True, True]]), 4, 1.0, gen)
    assert out.tolist() == [[0, 1, INVALID_STEP, INVALID_STEP]]
    # Same generator state, same draw.
    a = sample_timesteps(P, has, k, 1.0, torch.Generator().manual_seed(9))
    b = sample_timesteps(P, has, k, 1.0, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# 4. replay: o_t is the canvas the sampler saw before step t
# --------------------------------------------------------------------------------------------------
def _eos_biased(model, eos_id: int, bias: float):
    """Add a bias on the EOS logit, so that rows end early (and the sampler can stop at EOS)."""
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[eos_id] = bias
    model.lm_head = head
    return model


REPLAY_CASES = [
    ("llada", dict(unmasking="dynamic", threshold=0.3, cache="dual"), 0.0),
    ("llada", dict(unmasking="dynamic", threshold=0.3, cache="none", temperature=1.0), 8.0),
    ("dream", dict(unmasking="static", steps=4, cache="prefix", temperature=1.0), 0.0),
    ("dream", dict(unmasking="dynamic", threshold=0.3, cache="dual", temperature=1.0), 8.0),
]


def test_noisy_state_replays_the_sampler_canvases(tokenizer):
    prompt_ids = torch.tensor([[9, 10, 11, 12], [0, 0, 13, 14], [0, 15, 16, 17]])
    prompt_ids[prompt_ids == 0] = tokenizer.pad_token_id
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    P = prompt_ids.shape[1]
    seen = {"multi_token_step": False, "idle_row": False, "finished_row_waits": False, "early_stop": False}
    for case, (family, settings, eos_bias) in enumerate(REPLAY_CASES):
        model = _tiny_model(family, tokenizer)
        if eos_bias:
            _eos_biased(model, tokenizer.eos_token_id, eos_bias)
        canvases = []
        config = DiffusionGenerationConfig(gen_length=GEN, block_length=BLOCK, **settings)
        output = diffusion_generate(
            model, prompt_ids, prompt_mask, config, torch.Generator().manual_seed(case),
            step_callback=lambda step, canvas: canvases.append(canvas.clone()),
        )
        mask_id = model.config.mask_token_id
        for b in range(prompt_ids.shape[0]):
            row_canvases = []
            for canvas in canvases:
                assert torch.equal(canvas[b, :P], prompt_ids[b])
                if not row_canvases or not torch.equal(canvas[b, P:], row_canvases[-1]):
                    row_canvases.append(canvas[b, P:])
            # A row that finished its block before the others shows its state after its last step (t = num_steps)
            # while it idles in lock-step.
            num_steps = int(output.num_steps[b])
            assert num_steps <= len(row_canvases) <= num_steps + 1
            ids, steps = output.completion_ids[b : b + 1], output.commit_step[b : b + 1]
            for t in range(len(row_canvases)):
                replay = noisy_state(ids, steps, torch.tensor([t]), mask_id)[0]
                assert torch.equal(replay, row_canvases[t]), (case, b, t)
            seen["idle_row"] |= len(canvases) > len(row_canvases)
            seen["finished_row_waits"] |= len(row_canvases) > num_steps
            committed = steps[steps != NEVER_COMMITTED]
            seen["multi_token_step"] |= bool((committed.bincount() > 1).any())
            seen["early_stop"] |= bool((steps == NEVER_COMMITTED).any())
            # The final state is the completion itself, with never-decoded positions still masked.
            final = noisy_state(ids, steps, torch.tensor([num_steps]), mask_id)[0]
            never = steps[0] == NEVER_COMMITTED
            assert torch.equal(final[~never], ids[0][~never]) and (final[never] == mask_id).all()
    assert all(seen.values()), seen


def test_zero_variance_ignores_unscorable_completions_as_trl_does(llada_trainer):
    """A reward function returning None (NaN after TRL's gathering) for one completion: TRL's advantages take the
    group's spread with ``nanstd`` over the other completions, so a group whose other completions vary keeps its
    signal and must not be dropped; a group whose scored completions are all equal is dropped."""
    trainer = llada_trainer
    nan = float("nan")
    rewards = torch.tensor([[nan, 0.0, 1.0, 1.0], [nan, 0.5, 0.5, 0.5]]).view(8, 1)
    trainer._gathered_rewards = rewards
    try:
        for aggregation in ("normalize_then_sum", "sum_then_normalize"):
            trainer.args.multi_objective_aggregation = aggregation
            assert trainer._zero_variance_rows().tolist() == [False] * 4 + [True] * 4, aggregation
    finally:
        trainer.args.multi_objective_aggregation = "sum_then_normalize"
