"""Routing drift of a LLaDA2-shaped MoE block model (``Glm4MoeForCausalLM``): the experts each committed token was
routed to in its rollout forward (``record_routing``), and whether the loss forward routes it the same way
(``MoERLDFLoss``'s ``moe/*`` metrics).

The oracles read the routers with hooks written in this file (``gate_choices``) on plain forwards of replayed states:
``q ⊕ o_t`` built by hand, the prompt left-padded to a block boundary by hand, one forward per state; the drift is
recounted from those with Python sets.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dllm_trl import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.generation import NEVER_COMMITTED, MaskedDiffusionSampler
from dllm_trl.losses import INVALID_STEP, MoERLDFLoss
from tests.tiny_models import build_tiny_llada2, build_tiny_sdar
from dllm_trl.trainers import RLDFConfig, RLDFTrainer

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args
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


# --------------------------------------------------------------------------------------------------
# loss side: moe/routing_drift of the loss forward against the rollout's record
# --------------------------------------------------------------------------------------------------
def moe_loss(tmp_path):
    return MoERLDFLoss(tiny_training_args(RLDFConfig, tmp_path, max_completion_length=12, num_sampled_timesteps=3,
                                          beta=0.0))


def loss_forward_sums(model, loss, ids, between=None):
    """Rollout (recording what the loss asks the sampler for) → sampled states → targets → the packed loss forwards of
    every sampled step, as the trainer calls them; ``between(model)`` runs after the rollout. Returns the batch and the
    loss's metric sums."""
    prompt_mask = torch.ones_like(ids)
    config = DiffusionGenerationConfig(gen_length=12, block_length=BLOCK, threshold=0.5, temperature=1.0,
                                       stop_at_eos=False, **loss.sampler_requests())
    generator = torch.Generator().manual_seed(0)
    output = MaskedDiffusionSampler(config)(model, ids, prompt_mask, generator)
    batch, _ = loss.sample_states(ids, prompt_mask, output, generator, torch.Generator().manual_seed(1))
    if between is not None:
        between(model)
    batch["advantages"] = torch.linspace(-1.0, 1.0, ids.shape[0])
    with torch.no_grad():
        batch["target_mask"] = loss.target_mask(batch, loss.score_states(model, batch), BLOCK)
    batch["num_target_tokens"] = batch["target_mask"].sum()
    call = loss.begin(batch, loss.normalizer(batch, 1, 1.0), 0.0, 0.2, 0.2)
    steps = (batch["sampled_steps"] != INVALID_STEP).any(0).nonzero().squeeze(1).tolist()
    for chunk in loss.loss_chunks(model, batch, steps):
        loss.chunk_loss(model, batch, chunk, call)
    return batch, loss.metric_sums(batch, call)


def brute_force_drift(rollout_model, loss_model, ids, batch):
    """Over the tokens committed at each sampled step ``t`` (the ones whose rollout forward was the state ``o_t``'s):
    ``(pairs whose expert sets differ, (token, MoE layer) pairs, summed Jaccard overlap, tokens rerouted at some
    layer, tokens)``, from plain forwards of ``o_t`` under the rollout's and the loss's weights, as Python sets."""
    differing = pairs = rerouted = tokens = 0
    overlap = 0.0
    for b in range(ids.shape[0]):
        for t in batch["sampled_steps"][b].tolist():
            if t == INVALID_STEP:
                continue
            committed = (batch["commit_step"][b] == t) & batch["valid_mask"][b].bool()
            state = (ids[b], batch["rollout_ids"][b], batch["commit_step"][b], t)
            before = state_routing(rollout_model, *state)[committed].tolist()
            after = state_routing(loss_model, *state)[committed].tolist()
            for token_before, token_after in zip(before, after):
                sets = [(set(x), set(y)) for x, y in zip(token_before, token_after)]
                changed = sum(x != y for x, y in sets)
                differing, pairs, tokens = differing + changed, pairs + len(sets), tokens + 1
                rerouted += changed > 0
                overlap += sum(len(x & y) / len(x | y) for x, y in sets)
    return differing, pairs, overlap, rerouted, tokens


def test_routing_drift_is_zero_when_the_loss_forward_routes_as_the_rollout(tmp_path):
    """Same weights, exact block cache, float32: the packed loss forward routes every token committed at a sampled
    step exactly as the rollout step that committed it did."""
    model = make_llada2(layers=3)
    ids = prompts(4, 6, seed=5)
    batch, sums = loss_forward_sums(model, moe_loss(tmp_path), ids)
    differing, pairs, overlap, rerouted, tokens = brute_force_drift(model, model, ids, batch)
    assert differing == 0 and tokens > 10
    assert sums["moe/routing_drift"] == (0.0, pairs, True)
    assert sums["moe/rerouted_token_frac"] == (0.0, tokens, True)
    assert sums["moe/routing_overlap"] == (float(pairs), pairs, True)


def test_routing_drift_after_a_router_bias_change_equals_a_brute_force_recount(tmp_path):
    """The routers' ``e_score_correction_bias`` moves between the rollout and the loss forward: the metrics count the
    (token, layer) pairs whose expert sets changed, as plain forwards under both biases do."""
    model = make_llada2(layers=3)
    rollout_model = copy.deepcopy(model)
    ids = prompts(4, 6, seed=5)
    noise = torch.Generator().manual_seed(7)

    def move_bias(model):
        with torch.no_grad():
            for gate in moe_gates(model):
                bias = gate.e_score_correction_bias
                bias.add_(torch.randn(bias.shape, generator=noise) * 0.2)

    batch, sums = loss_forward_sums(model, moe_loss(tmp_path), ids, between=move_bias)
    differing, pairs, overlap, rerouted, tokens = brute_force_drift(rollout_model, model, ids, batch)
    assert 0 < differing < pairs
    drift, overlap_sum = sums["moe/routing_drift"], sums["moe/routing_overlap"]
    assert (float(drift[0]), float(drift[1])) == (differing, pairs)
    assert tuple(map(float, sums["moe/rerouted_token_frac"][:2])) == (rerouted, tokens)
    assert math.isclose(float(overlap_sum[0]), overlap, rel_tol=1e-6) and float(overlap_sum[1]) == pairs


def test_routing_drift_loss_refuses_a_model_without_routers(tmp_path):
    model = build_tiny_sdar(vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS, hidden_size=32,
                            intermediate_size=64, block_size=BLOCK)
    with pytest.raises(ValueError, match="router"):
        moe_loss(tmp_path).check_model(model)


def test_rldf_trainer_logs_the_routing_drift_of_moe_rldf_loss(tmp_path):
    """Passed as ``loss=``, the loss asks the trainer's sampler for the routing record; on-policy, with the exact
    block cache, every logged step shows no drift."""
    tokenizer = make_char_tokenizer()
    model = build_tiny_llada2(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                              eos_token_id=tokenizer.eos_token_id, block_size=BLOCK, hidden_size=32,
                              intermediate_size=64, moe_intermediate_size=16)
    args = tiny_training_args(RLDFConfig, tmp_path)
    trainer = RLDFTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=addition_dataset(),
                          processing_class=tokenizer, loss=MoERLDFLoss(args))
    assert trainer.sampler.config.record_routing
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    assert all(entry["moe/routing_drift"] == 0.0 and entry["moe/routing_overlap"] == 1.0 for entry in logged), logged
