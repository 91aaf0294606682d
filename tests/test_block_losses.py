"""RLDF on block-diffusion models: every sampled state of a completion scored in one packed forward (SPEC §7).

The packing (ids, position ids, the mask of clean ⊕ noisy block copies) is checked against masks built with Python
loops from the rule of SPEC §7. The trainer's loss and gradients — packed forwards, targets restricted to the state's
block — are compared with a brute-force reference that scores each state separately: ``q ⊕ o_t`` built by hand, the
prompt left-padded to a block boundary by hand, one plain forward per state with a block-causal mask built with
Python loops, target sets from Python sets, Eq. 10's aggregation (``reference_loss`` of the RLDF loss tests).
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from dllm_trl.losses.estimators import estimator_targets
from dllm_trl.losses.packed_states import (
    in_state_block,
    pack_block_copies,
    pack_sampled_states,
    packed_read_positions,
    state_blocks,
)
from dllm_trl.losses.rldf_terms import INVALID_STEP
from tests.tiny_models import build_tiny_fast_dllm_v2, build_tiny_sdar
from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFConfig, RLDFTrainer
from dllm_trl.losses import rldf_loss as rldf_loss_module

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args
from .test_rldf_loss import (
    EPS_HIGH,
    EPS_LOW,
    GEN,
    K,
    VOCAB,
    _assert_grads_close,
    _assert_target_mask,
    _backward,
    _grads,
    add_old_and_ref,
    loss_test_trainer,
    prepare_batch,
    random_batch,
    reference_loss,
    trainable_params,
)

BLOCK = 4  # the attention block of the models here = the decoding block of random_batch
FORMATS = ("sdar", "fast_dllm_v2")


# --------------------------------------------------------------------------------------------------
# models, trainers, trajectories
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from dllm_trl.toy.tokenizer import build_toy_tokenizer

    return build_toy_tokenizer()


def block_model(fmt: str, tokenizer, head_scale: float = 30.0):
    build = build_tiny_sdar if fmt == "sdar" else build_tiny_fast_dllm_v2
    model = build(
        mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, seed=5,
        block_size=BLOCK,
    )
    with torch.no_grad():  # a sharp head, so that probabilities spread over (0, 1) and thresholds matter
        model.lm_head.weight.mul_(head_scale)
    return model


def _build_trainer(fmt, tokenizer, tmp_path_factory):
    return loss_test_trainer(block_model(fmt, tokenizer), tokenizer, str(tmp_path_factory.mktemp(f"block-{fmt}")))


@pytest.fixture(scope="module")
def sdar_trainer(tokenizer, tmp_path_factory):
    return _build_trainer("sdar", tokenizer, tmp_path_factory)


@pytest.fixture(scope="module")
def fast_dllm_v2_trainer(tokenizer, tmp_path_factory):
    return _build_trainer("fast_dllm_v2", tokenizer, tmp_path_factory)


@pytest.fixture(params=FORMATS)
def trainer(request):
    """SDAR (no logit shift) and Fast-dLLM v2 (logit shift: a block's first position is read before the block)."""
    return request.getfixturevalue(f"{request.param}_trainer")


def block_batch(tokenizer, seed):
    """``random_batch`` (G = 8: two blocks decoded in order, EOS, padding steps, A = 0 …) with one more padding
    column on the prompts (width 5: the packing and the sampler pad them to 8, a block boundary)."""
    batch = random_batch(tokenizer, seed)
    rows = batch["rollout_prompt_ids"].shape[0]
    batch["rollout_prompt_ids"] = torch.cat([torch.full((rows, 1), 7), batch["rollout_prompt_ids"]], dim=1)
    batch["rollout_prompt_mask"] = torch.cat([torch.zeros(rows, 1, dtype=torch.long), batch["rollout_prompt_mask"]], 1)
    return batch


def _configure(trainer, *, norm="token", c=0.2, beta=0.0, backward_mode="per_step", targets_from_loss=True):
    trainer.args.backward_mode = backward_mode
    trainer.defer_clean_targets = targets_from_loss
    trainer.args.loss_normalization = norm
    trainer.args.clean_target_threshold = c
    trainer.beta = beta
    trainer.epsilon_low, trainer.epsilon_high = EPS_LOW, EPS_HIGH


# --------------------------------------------------------------------------------------------------
# brute-force reference: each state scored separately (SPEC §2.2, §7)
# --------------------------------------------------------------------------------------------------
def state_block_positions(batch, b, j) -> set[int]:
    t = int(batch["sampled_steps"][b, j])
    block = min(i for i in range(GEN) if int(batch["commit_step"][b, i]) == t) // BLOCK
    return set(range(block * BLOCK, (block + 1) * BLOCK))


def reference_state_logps(model, batch) -> dict:
    """{(b, j): [log π(o_i | q, o_t) for i < G]} for every sampled state, one plain forward each: the prompt
    left-padded to a block boundary, ``o_t`` built by hand, a block-causal 4-D mask built with loops (key k visible
    to query q iff k is real and k // B <= q // B, or k = q)."""
    mask_id = model.config.mask_token_id
    shift = 1 if model.config.diffusion_logit_shift else 0
    width = batch["rollout_prompt_ids"].shape[1]
    pad = -width % BLOCK
    P = width + pad
    out = {}
    for b in range(batch["rollout_ids"].shape[0]):
        ids = batch["rollout_ids"][b].tolist()
        steps = batch["commit_step"][b].tolist()
        prompt = [mask_id] * pad + batch["rollout_prompt_ids"][b].tolist()
        real = [0] * pad + batch["rollout_prompt_mask"][b].tolist() + [1] * GEN
        for j, t in enumerate(batch["sampled_steps"][b].tolist()):
            if t == INVALID_STEP:
                continue
            o_t = [mask_id if steps[i] >= t else ids[i] for i in range(GEN)]
            n = P + GEN
            keep = torch.zeros(1, 1, n, n, dtype=torch.bool)
            for q in range(n):
                for k in range(n):
                    keep[0, 0, q, k] = (bool(real[k]) and k // BLOCK <= q // BLOCK) or k == q
            logits = model(input_ids=torch.tensor([prompt + o_t]), attention_mask=keep).logits[0]
            logp = logits.float().log_softmax(-1)
            out[b, j] = torch.stack([logp[P + i - shift, ids[i]] for i in range(GEN)])
    return out


def reference_targets(batch, current, c, ppo) -> dict:
    """Ô_t = (I_t ∪ {i in the state's block : step > t, p_i ≥ c}) ∩ valid."""
    targets = {}
    for (b, j), logps in current.items():
        t = int(batch["sampled_steps"][b, j])
        steps = batch["commit_step"][b].tolist()
        valid = {i for i in range(GEN) if batch["valid_mask"][b, i]}
        source = batch["old_per_token_logps"][b, j] if ppo else logps.detach()
        block = state_block_positions(batch, b, j)
        committed_now = {i for i in range(GEN) if steps[i] == t}
        predicted = {i for i in block if steps[i] > t and math.exp(float(source[i])) >= c}
        targets[b, j] = sorted((committed_now | predicted) & valid)
    return targets


def midpoint_threshold(batch, current, ppo) -> float:
    """A threshold between two well-separated probabilities of still-masked valid tokens of the states' blocks."""
    probs = []
    for (b, j), logps in current.items():
        t = int(batch["sampled_steps"][b, j])
        source = batch["old_per_token_logps"][b, j] if ppo else logps.detach()
        for i in state_block_positions(batch, b, j):
            if batch["commit_step"][b, i] > t and batch["valid_mask"][b, i]:
                probs.append(math.exp(float(source[i])))
    probs.sort()
    gaps = [(abs(i - len(probs) / 2), (lo + hi) / 2) for i, (lo, hi) in enumerate(zip(probs, probs[1:])) if hi - lo > 1e-4]
    return min(gaps)[1]


def count_forwards(model):
    """A list that grows by one per forward of ``model``'s decoder (and the handle to remove the hook)."""
    calls = []
    handle = model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    return calls, handle


# --------------------------------------------------------------------------------------------------
# 1. packing, tensor level
# --------------------------------------------------------------------------------------------------
def test_packed_mask_follows_the_rule():
    """Clean part block-causal on itself; copy j sees the clean blocks before its block and itself; padding keys
    hidden; every query sees itself."""
    gen = torch.Generator().manual_seed(0)
    rows, B = 2, 2
    prompt_ids = torch.randint(3, 9, (rows, 3), generator=gen)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    clean = torch.randint(3, 9, (rows, 4), generator=gen)
    copies = torch.randint(3, 9, (rows, 3, B), generator=gen)
    copy_blocks = torch.tensor([[0, 1, 1], [1, 0, -1]])
    copy_real = copy_blocks >= 0
    packed = pack_block_copies(prompt_ids, prompt_mask, clean, copies, copy_blocks, copy_real, B, fill_id=2)
    P = 4  # 3 prompt columns padded to 4
    assert packed.prompt_width == P and packed.copy_start == P + 4
    n = P + 4 + 3 * B
    assert packed.input_ids.shape == packed.position_ids.shape == (rows, n)
    for r in range(rows):
        real = [0] + prompt_mask[r].tolist() + [1] * 4 + [int(x) for x in copy_real[r] for _ in range(B)]
        block = [c // B for c in range(P + 4)] + [P // B + max(int(x), 0) for x in copy_blocks[r] for _ in range(B)]
        copy = [0] * (P + 4) + [j + 1 for j in range(3) for _ in range(B)]
        for c in range(n):
            if c >= P + 4:
                j, o = divmod(c - P - 4, B)
                assert packed.input_ids[r, c] == copies[r, j, o]
                assert packed.position_ids[r, c] == P + max(int(copy_blocks[r, j]), 0) * B + o
        for q in range(n):
            for k in range(n):
                if copy[k] == 0:
                    visible = block[k] < block[q] or (copy[q] == 0 and block[k] == block[q])
                else:
                    visible = copy[k] == copy[q]
                expected = (visible and bool(real[k])) or k == q
                assert bool(packed.attention_mask[r, 0, q, k]) == expected, (r, q, k)


def test_sampled_states_and_read_positions(tokenizer):
    batch = block_batch(tokenizer, seed=3)
    steps, commit = batch["sampled_steps"], batch["commit_step"]
    blocks = state_blocks(commit, steps, BLOCK)
    for b in range(steps.shape[0]):
        for j in range(K):
            if steps[b, j] == INVALID_STEP:
                assert blocks[b, j] == -1
            else:
                assert {blocks[b, j].item() * BLOCK + o for o in range(BLOCK)} == state_block_positions(batch, b, j)
                in_block = in_state_block(commit[b : b + 1], steps[b : b + 1, j], BLOCK)[0]
                assert set(in_block.nonzero().squeeze(1).tolist()) == state_block_positions(batch, b, j)
    packed = pack_sampled_states(batch["rollout_prompt_ids"], batch["rollout_prompt_mask"], batch["rollout_ids"],
                                 commit, steps, BLOCK, tokenizer.mask_token_id)
    clean = packed.copy_start - packed.prompt_width
    assert clean == blocks.max() * BLOCK  # only as many clean blocks as the latest state needs
    for b in range(steps.shape[0]):
        for j in range(K):
            if steps[b, j] == INVALID_STEP:
                continue
            t, n = int(steps[b, j]), int(blocks[b, j])
            copy = packed.input_ids[b, packed.copy_start + j * BLOCK : packed.copy_start + (j + 1) * BLOCK]
            o_t = batch["rollout_ids"][b].masked_fill(commit[b] >= t, tokenizer.mask_token_id)
            assert torch.equal(copy, o_t[n * BLOCK : (n + 1) * BLOCK])
    read = torch.zeros(steps.shape[0], K, GEN, dtype=torch.bool)
    read[0, 0, int(blocks[0, 0]) * BLOCK] = True
    read[0, 1, int(blocks[0, 1]) * BLOCK + 2] = True
    for shift in (0, 1):
        rows, columns, (r, j, i) = packed_read_positions(packed, read, shift)
        first = packed.prompt_width + int(blocks[0, 0]) * BLOCK - 1 if shift else packed.copy_start
        assert columns.tolist() == [first, packed.copy_start + BLOCK + 2 - shift] and rows.tolist() == [0, 0]
    read[0, 0, (int(blocks[0, 0]) + 1) % 2 * BLOCK] = True  # a position of the other block
    with pytest.raises(ValueError, match="outside their state's block"):
        packed_read_positions(packed, read, 0)


def test_block_targets_exclude_later_blocks(tokenizer):
    batch = block_batch(tokenizer, seed=4)
    for j in range(K):
        targets, _ = estimator_targets("rldf", commit_step=batch["commit_step"], valid_mask=batch["valid_mask"],
                                       step=batch["sampled_steps"][:, j], clean_prob=torch.ones(6, GEN),
                                       clean_threshold=0.0, block_size=BLOCK)
        for b in range(6):
            if batch["sampled_steps"][b, j] != INVALID_STEP:
                assert set(targets[b].nonzero().squeeze(1).tolist()) <= state_block_positions(batch, b, j)
    with pytest.raises(ValueError, match="no block-diffusion form"):
        estimator_targets("all_masking", commit_step=batch["commit_step"], valid_mask=batch["valid_mask"],
                          step=batch["sampled_steps"][:, 0], block_size=BLOCK)


# --------------------------------------------------------------------------------------------------
# 2. loss and gradients: packed forwards = each state scored separately
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective, norm, beta, backward_mode, targets_from_loss", [
    ("reinforce", "token", 0.0, "per_step", True),
    ("reinforce", "token", 0.0, "per_step", False),
    ("ppo", "sample", 0.05, "per_step", True),
    ("ppo", "token", 0.05, "per_micro_batch", True),
    ("reinforce", "sample", 0.05, "per_micro_batch", True),
    ("reinforce", "sample", 0.05, "per_micro_batch", False),
])
def test_packed_loss_and_grads_match_bruteforce(trainer, tokenizer, objective, norm, beta, backward_mode,
                                                targets_from_loss):
    """On-policy REINFORCE fixes the clean targets in the packed loss forward itself (or, ``targets_from_loss``
    False, in a separate packed π_old pass); PPO reads them from π_old."""
    ppo = objective == "ppo"
    model = trainer.model
    batch = block_batch(tokenizer, seed=11)
    current = reference_state_logps(model, batch)
    batch = add_old_and_ref(batch, current, seed=12, ppo=ppo, beta=beta > 0)
    c = midpoint_threshold(batch, current, ppo)
    targets = reference_targets(batch, current, c, ppo)
    committed_now = sum(int(((batch["commit_step"][b] == batch["sampled_steps"][b, j]) & batch["valid_mask"][b].bool()).sum())
                        for b, j in targets)
    assert sum(len(v) for v in targets.values()) > committed_now, "the threshold should add clean targets"
    expected = reference_loss(batch, current, targets, ppo=ppo, beta=beta, norm=norm)
    expected_grads = _grads(expected, trainable_params(model))

    _configure(trainer, norm=norm, c=c, beta=beta, backward_mode=backward_mode, targets_from_loss=targets_from_loss)
    inputs = prepare_batch(trainer, batch)
    assert ("targets_pending" in inputs) == (targets_from_loss and not ppo)
    if "targets_pending" not in inputs:
        _assert_target_mask(inputs, targets)
    calls, handle = count_forwards(model)
    try:
        loss, grads = _backward(trainer, inputs)
    finally:
        handle.remove()
    _assert_target_mask(inputs, targets)  # pending targets are written back by the loss forward
    assert len(calls) == 1, f"{len(calls)} forwards: all {K} sampled states should share one packed forward"
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads_close(grads, expected_grads)


@pytest.mark.parametrize("states_per_forward", [1, 2])
def test_chunked_packing_gives_the_same_loss_and_grads(trainer, tokenizer, states_per_forward):
    """Fewer states per packed forward (to bound memory): one forward and one backward per chunk, same result."""
    batch = block_batch(tokenizer, seed=21)
    current = reference_state_logps(trainer.model, batch)
    batch = add_old_and_ref(batch, current, seed=22, ppo=True, beta=True)
    targets = reference_targets(batch, current, 0.2, ppo=True)
    expected = reference_loss(batch, current, targets, ppo=True, beta=0.05, norm="token")
    expected_grads = _grads(expected, trainable_params(trainer.model))
    _configure(trainer, norm="token", c=0.2, beta=0.05)
    with mock.patch.object(rldf_loss_module, "states_per_forward", lambda *args: states_per_forward):
        inputs = prepare_batch(trainer, batch)
        calls, handle = count_forwards(trainer.model)
        try:
            loss, grads = _backward(trainer, inputs)
        finally:
            handle.remove()
    assert len(calls) == math.ceil(K / states_per_forward)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads_close(grads, expected_grads)


def test_scoring_pass_is_packed_and_scores_the_candidates(trainer, tokenizer):
    """The no-grad pass TRL runs for π_old / π_ref (and RLDF's target pass): packed, the state's block only."""
    batch = block_batch(tokenizer, seed=31)
    calls, handle = count_forwards(trainer.model)
    try:
        with torch.no_grad():
            scored = trainer.loss.score_states(trainer.model, batch, batch_size=3)
    finally:
        handle.remove()
    assert len(calls) == 2  # two row chunks, every state of a chunk in one forward
    current = reference_state_logps(trainer.model, batch)
    for (b, j), logps in current.items():
        read = torch.zeros(GEN, dtype=torch.bool)
        read[sorted(state_block_positions(batch, b, j))] = True
        read &= (batch["commit_step"][b] >= batch["sampled_steps"][b, j]) & batch["valid_mask"][b].bool()
        torch.testing.assert_close(scored[b, j][read], logps.detach()[read], atol=1e-5, rtol=1e-5)
        assert (scored[b, j][~read] == 0).all()
    assert (scored[batch["sampled_steps"] == INVALID_STEP] == 0).all()


# --------------------------------------------------------------------------------------------------
# 3. trainers end to end on a block model (rollout, π_old pass, loss, optimizer step)
# --------------------------------------------------------------------------------------------------
def _char_block_model(fmt="sdar"):
    tokenizer = make_char_tokenizer()
    build = build_tiny_sdar if fmt == "sdar" else build_tiny_fast_dllm_v2
    model = build(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                  eos_token_id=tokenizer.eos_token_id, block_size=BLOCK)
    return model, tokenizer


@pytest.mark.parametrize("fmt", FORMATS)
def test_rldf_trains_a_block_model(tmp_path, fmt):
    model, tokenizer = _char_block_model(fmt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = tiny_training_args(RLDFConfig, tmp_path, num_iterations=2, gradient_accumulation_steps=2)
    trainer = RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                          processing_class=tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(math.isfinite(entry["loss"]) for entry in logged)
    assert any((p.detach() - before[n]).abs().max() > 0 for n, p in trainer.model.named_parameters())


def test_dppo_mask_on_a_block_model_sees_the_rollout_distribution(tmp_path):
    """μ of the tokens committed at the sampled step is the rollout's record; with the exact block cache it is the
    training forward's distribution, so on the first (on-policy) step every such token has ratio π_θ / μ = 1."""
    model, tokenizer = _char_block_model("fast_dllm_v2")
    args = tiny_training_args(DPPOMaskConfig, tmp_path, divergence_top_k=4, max_steps=1)
    trainer = DPPOMaskTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                              processing_class=tokenizer)
    assert trainer.model_kind == "diffusion"
    trainer.loss.records = []
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(math.isfinite(entry["loss"]) for entry in logged)
    tokens = {name: torch.cat([r[name] for r in trainer.loss.records]) for name in trainer.loss.records[0]}
    from_rollout = tokens["from_rollout"].bool()
    assert from_rollout.sum() > 0
    torch.testing.assert_close(tokens["log_ratio"][from_rollout], torch.zeros(int(from_rollout.sum())), atol=1e-4, rtol=0)
    assert tokens["div"][from_rollout].abs().max() < 1e-4


def test_non_trajectory_estimators_are_refused_for_block_models(tmp_path):
    model, tokenizer = _char_block_model()
    args = tiny_training_args(RLDFConfig, tmp_path, policy_estimator="random_masking")
    with pytest.raises(ValueError, match="no block-diffusion form"):
        RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                    processing_class=tokenizer)
