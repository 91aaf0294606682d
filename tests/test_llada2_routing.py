"""Routing drift of a LLaDA2-shaped MoE block model (``Glm4MoeForCausalLM``): the experts each committed token was
routed to in its rollout forward, and whether the loss forward routes it the same way.

The oracles here read the routers with hooks written in this file (``gate_choices``) on plain forwards of replayed
states: ``q ⊕ o_t`` built by hand, the prompt left-padded to a block boundary by hand, one forward per state.
"""

from __future__ import annotations

import pytest
import torch

from dllm_trl import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.generation import NEVER_COMMITTED
from dllm_trl.testing import build_tiny_sdar

from .test_generation import EOS, MASK, VOCAB, prompts
from .test_llada2_generation import BLOCK, make_llada2


def moe_gates(model):
    """The routers of the MoE layers (the first layer is dense), in layer order."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def gate_choices(model, input_ids, attention_mask):
    """(B, N, MoE layers, k): the experts each router picks for each token in one plain forward."""
    chosen = []
    handles = [gate.register_forward_hook(lambda module, args, output: chosen.append(output[2]))
               for gate in moe_gates(model)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(chosen, dim=1).view(*input_ids.shape, len(chosen), -1)


def state_routing(model, prompt, completion, commit_step, t):
    """(G, MoE layers, k): the experts of each completion position in a plain forward of the state ``o_t`` (the
    positions committed at ``t`` or later masked) after ``prompt``, left-padded to a block boundary."""
    pad = -prompt.numel() % BLOCK
    state = completion.masked_fill(commit_step >= t, MASK)
    canvas = torch.cat([torch.full((pad,), MASK), prompt, state])[None]
    key_mask = torch.ones_like(canvas)
    key_mask[0, :pad] = 0
    return gate_choices(model, canvas, key_mask)[0, pad + prompt.numel():]


def same_sets(a, b):
    return torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


def generate(model, ids, **overrides):
    settings = dict(gen_length=12, block_length=BLOCK, threshold=0.5, cache="dual", stop_at_eos=False, temperature=1.0,
                    seed=0)
    settings.update(overrides)
    return diffusion_generate(model, ids, generation_config=DiffusionGenerationConfig(**settings))


# --------------------------------------------------------------------------------------------------
# rollout side: the sampler's routing record
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_rollout_records_the_experts_of_each_token_at_its_commit_step(cache):
    """Every committed token's record = the experts its position was routed to in a plain forward of the state it was
    committed from (the mask token there), at every MoE layer."""
    model = make_llada2(layers=3)
    ids = prompts(2, 6, seed=2)
    out = generate(model, ids, cache=cache, record_routing=True)
    gates = moe_gates(model)
    assert out.routed_experts.shape == (2, 12, len(gates), model.config.num_experts_per_tok)
    assert not any(gate._forward_hooks for gate in gates), "the sampler left its hooks on the routers"
    for b in range(2):
        for t in range(int(out.num_steps[b])):
            committed = out.commit_step[b] == t
            expected = state_routing(model, ids[b], out.completion_ids[b], out.commit_step[b], t)
            assert same_sets(out.routed_experts[b][committed], expected[committed]), (b, t)


def test_cached_and_uncached_rollouts_record_the_same_routing():
    model = make_llada2(layers=3)
    ids = prompts(3, 5, seed=3)
    cached = generate(model, ids, cache="dual", record_routing=True)
    uncached = generate(model, ids, cache="none", record_routing=True)
    assert torch.equal(cached.commit_step, uncached.commit_step)
    assert same_sets(cached.routed_experts, uncached.routed_experts)


def test_routing_is_not_recorded_by_default_and_never_for_uncommitted_positions():
    model = make_llada2(layers=2)
    ids = prompts(1, 5, seed=1)
    assert generate(model, ids).routed_experts is None
    with torch.no_grad():  # an EOS-prone head: decoding stops early, the blocks after the EOS are never decoded
        model.lm_head.weight[EOS] = 3.0
    out = generate(model, ids, record_routing=True, stop_at_eos=True, gen_length=16)
    never = out.commit_step == NEVER_COMMITTED
    assert never.any() and (out.routed_experts[never] == -1).all() and (out.routed_experts[~never] >= 0).all()


def test_record_routing_needs_a_model_with_routers():
    model = build_tiny_sdar(vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS, hidden_size=32,
                            intermediate_size=64, block_size=BLOCK)
    with pytest.raises(ValueError, match="router"):
        generate(model, prompts(1, 5), record_routing=True)
