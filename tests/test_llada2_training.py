"""RLDF and the diffusion trust-region trainer on a LLaDA2-shaped MoE block model (``Glm4MoeForCausalLM``, SPEC §7–8).

The packed-state oracles of the dense block models (``test_block_losses``) run unchanged on the MoE model: the loss
and gradients of the packed forwards equal a brute-force reference that scores every sampled state in its own plain
forward (the MoE router is per token, so packing changes no routing). Then both trainers run two steps end to end.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.tiny_models import build_tiny_llada2
from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFConfig, RLDFTrainer

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args
from .test_block_losses import BLOCK, test_chunked_packing_gives_the_same_loss_and_grads  # noqa: F401
from .test_block_losses import test_packed_loss_and_grads_match_bruteforce  # noqa: F401
from .test_rldf_loss import VOCAB, loss_test_trainer


@pytest.fixture(scope="module")
def tokenizer():
    from dllm_trl.toy.tokenizer import build_toy_tokenizer

    return build_toy_tokenizer()


@pytest.fixture(scope="module")
def trainer(tokenizer, tmp_path_factory):
    """The hand-driven trainer of the block-loss oracles, on a tiny LLaDA2 model (imported tests take it)."""
    model = build_tiny_llada2(
        mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        moe_intermediate_size=16, seed=5, block_size=BLOCK,
    )
    with torch.no_grad():  # a sharp head, so that probabilities spread over (0, 1) and thresholds matter
        model.lm_head.weight.mul_(30.0)
    return loss_test_trainer(model, tokenizer, str(tmp_path_factory.mktemp("llada2")))


def _char_llada2():
    tokenizer = make_char_tokenizer()
    model = build_tiny_llada2(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                              eos_token_id=tokenizer.eos_token_id, block_size=BLOCK, hidden_size=32,
                              intermediate_size=64, moe_intermediate_size=16)
    return model, tokenizer


def _trains(trainer, before):
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(math.isfinite(entry["loss"]) for entry in logged)
    changed = {n for n, p in trainer.model.named_parameters() if (p.detach() - before[n]).abs().max() > 0}
    assert any("experts" in n for n in changed) and any("self_attn" in n for n in changed), changed
    return logged


def test_rldf_trains_llada2(tmp_path):
    model, tokenizer = _char_llada2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = tiny_training_args(RLDFConfig, tmp_path, num_iterations=2)
    trainer = RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                          processing_class=tokenizer)
    trainer.train()
    _trains(trainer, before)


def test_dppo_mask_trains_llada2_on_the_rollout_distribution(tmp_path):
    """μ of the tokens committed at the sampled step is the rollout's record; with the exact block cache it is the
    training forward's distribution, so on the first (on-policy) step their ratio π_θ / μ is 1."""
    model, tokenizer = _char_llada2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = tiny_training_args(DPPOMaskConfig, tmp_path, divergence_top_k=4)
    trainer = DPPOMaskTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                              processing_class=tokenizer)
    trainer.loss.records = []
    trainer.train()
    _trains(trainer, before)
    first = trainer.loss.records[: args.gradient_accumulation_steps]
    tokens = {name: torch.cat([r[name] for r in first]) for name in first[0]}
    from_rollout = tokens["from_rollout"].bool()
    assert from_rollout.sum() > 0
    torch.testing.assert_close(tokens["log_ratio"][from_rollout], torch.zeros(int(from_rollout.sum())), atol=1e-4,
                               rtol=0)
