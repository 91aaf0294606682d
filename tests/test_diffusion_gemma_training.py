"""RLDF on DiffusionGemma (``DiffusionGemmaRLDFLoss`` over ``DiffusionGemmaSampler``'s record, SPEC §2 on §8).

Oracles: (a) the loss and its gradients on sampled steps equal a brute-force reference written here — one state at a
time, each row alone and unpadded, its prompt and finished canvases encoded through the encoder's own 2-D-mask path,
the decoder called with the rollout's self-conditioning *logits* (the exact input), the per-token terms written from
the formulas (REINFORCE, k3 KL, ``sample`` normalisation, clipped clean targets at threshold ``c``); under the
``"logits"`` carrier for every weight, under the ``"embedding"`` carrier with the embeddings frozen (LoRA's case),
which is exactly where that carrier claims exactness. (b) Two ``RLDFTrainer`` steps run with a finite loss, and with
frozen embeddings the two carriers train to the same weights. (c) Masked-diffusion settings on a DiffusionGemma run are
refused early, naming the field and the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from dllm_trl import RLDFConfig, RLDFTrainer, load_diffusion_model
from dllm_trl.trainers import DiffusionDPPOMaskTrainer, DPPOMaskConfig, DPPOMaskTrainer
from dllm_trl.generation import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig, MaskedDiffusionSampler
from dllm_trl.generation.diffusion_gemma import cache_keyword
from dllm_trl.losses import RLDFLoss
from dllm_trl.losses.diffusion_gemma_loss import DiffusionGemmaRLDFLoss, DiffusionGemmaTrustRegionLoss
from dllm_trl.models import set_diffusion_properties
from tests.tiny_models import build_tiny_diffusion_gemma
from dllm_trl.toy import build_toy_tokenizer, toy_dataset

from .test_diffusion_gemma_generation import PROMPTS, left_padded

CANVAS = 8
GEN = 2 * CANVAS
EOS = 63


def make_model(seed: int = 0, **kwargs):
    model = build_tiny_diffusion_gemma(seed=seed, canvas_length=CANVAS, **kwargs)
    with torch.no_grad():
        model.model.decoder.norm.weight.add_(24.0)  # confident enough to accept several positions per step
    return model


def make_args(estimator: str = "rldf", beta: float = 0.05, **overrides) -> RLDFConfig:
    values = dict(max_completion_length=GEN, block_length=CANVAS, num_sampled_timesteps=3, policy_estimator=estimator,
                  clean_target_threshold=0.1, loss_normalization="sample", beta=beta, use_cpu=True, report_to="none",
                  save_strategy="no", num_generations=3, per_device_train_batch_size=3)
    values.update(overrides)
    return RLDFConfig("/tmp/dllm-trl-diffusion-gemma-test", **values)


def rollout(model, carrier: str, seed: int = 2, record_topk: int = 0):
    config = DiffusionGemmaSamplerConfig(gen_length=GEN, max_denoising_steps=5, entropy_bound=0.5,
                                         confidence_threshold=0.5, eos_token_id=EOS, self_conditioning=carrier,
                                         record_topk=record_topk)
    ids, mask = left_padded(PROMPTS)
    torch.manual_seed(seed)
    return ids, mask, DiffusionGemmaSampler(config)(model, ids, mask)


# ------------------------------------------------------------------------------------------ brute-force reference
def reference_logits(model, prompt, completion, canvas, state, sc_logits):
    """The decoder's logits at one state, for one unpadded row: encoder over the prompt, then each finished canvas
    before ``canvas``, then the decoder reading that cache (positions continue after the encoded tokens)."""
    cache = DynamicCache(config=model.config.get_text_config())
    encoded = 0
    chunks = [prompt] + [completion[c * CANVAS : (c + 1) * CANVAS] for c in range(canvas)]
    for chunk in chunks:
        positions = torch.arange(encoded, encoded + chunk.numel()).unsqueeze(0)
        model.model.encoder(input_ids=chunk.unsqueeze(0), position_ids=positions, **{cache_keyword(model): cache})
        encoded += chunk.numel()
    positions = torch.arange(encoded, encoded + CANVAS).unsqueeze(0)
    return model(decoder_input_ids=state.unsqueeze(0), decoder_position_ids=positions, **{cache_keyword(model): cache},
                 self_conditioning_logits=None if sc_logits is None else sc_logits.unsqueeze(0)).logits[0]


def reference_loss(model, ref_model, args, ids, mask, output, exact, sampled, advantages, old_model=None):
    """Σ over rows and sampled steps of the per-token terms, from the formulas, with ``exact``'s self-conditioning
    logits (a ``"logits"``-carrier rollout of the same trajectory); PPO's clipped ratio against ``old_model`` when
    given (which then also fixes the clean targets), REINFORCE otherwise."""
    record, logits_record = output.denoising_steps, exact.denoising_steps
    rows = ids.shape[0]
    total = 0.0
    for b in range(rows):
        prompt = ids[b][mask[b].bool()]
        steps = [int(s) for s in sampled[b] if s >= 0]
        for s in steps:
            c = int(record.canvas[s])
            sc = logits_record.self_conditioning[b, s] if bool(record.has_self_conditioning[s]) else None
            state = record.state_ids[b, s]
            temperature = record.temperature[s]
            logps = (reference_logits(model, prompt, output.completion_ids[b], c, state, sc) / temperature).log_softmax(-1)
            accept = record.accept_mask[b, s]
            final = output.completion_ids[b, c * CANVAS : (c + 1) * CANVAS]
            target = torch.where(accept, record.accepted_ids[b, s], final)
            token_logps = logps.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            old = token_logps.detach()
            if old_model is not None:
                with torch.no_grad():
                    old = (reference_logits(old_model, prompt, output.completion_ids[b], c, state, sc)
                           / temperature).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
            targets = accept.clone()
            if args.policy_estimator == "rldf":
                valid = output.completion_mask[b, c * CANVAS : (c + 1) * CANVAS].bool()
                targets |= valid & (old.exp() >= args.clean_target_threshold)
            if old_model is None:
                terms = -advantages[b] * token_logps
            else:
                ratio = (token_logps - old).exp()
                terms = -torch.min(ratio * advantages[b], ratio.clamp(0.8, 1.2) * advantages[b])
            if args.beta:
                with torch.no_grad():
                    ref = (reference_logits(ref_model, prompt, output.completion_ids[b], c, state, sc)
                           / temperature).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
                delta = ref - token_logps
                terms = terms + args.beta * (delta.exp() - delta - 1)
            total = total + (terms * targets).sum() / (targets.sum() * len(steps) * rows)
    return total


def loss_under_test(loss, model, ref_model, ids, mask, output, advantages, old_model=None):
    trajectory, _ = loss.sample_states(ids, mask, output, torch.Generator().manual_seed(7), None)
    batch = dict(trajectory, advantages=advantages)
    with torch.no_grad():
        old = loss.score_states(model if old_model is None else old_model, batch)
        if old_model is not None:
            batch["old_per_token_logps"] = old
        if loss.args.beta:
            batch["ref_per_token_logps"] = loss.score_states(ref_model, batch)
    batch["target_mask"] = loss.target_mask(batch, old if loss.targets_need_old_policy else None, None)
    call = loss.begin(batch, loss.normalizer(batch, 1, 1.0), loss.args.beta, 0.2, 0.2)
    steps = (batch["sampled_steps"] >= 0).any(0).nonzero().squeeze(1).tolist()
    value = sum(loss.chunk_loss(model, batch, chunk, call) for chunk in loss.loss_chunks(model, batch, steps))
    return value, batch


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_model(model):
    """The KL reference: the policy with every transformer layer perturbed but the same embeddings (as the base model
    under LoRA), which is what the ``"embedding"`` carrier needs to be exact for the reference too."""
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in reference.model.decoder.layers.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return reference


def assert_close_to_scale(actual, expected, name, rel=1e-4):
    """Elementwise agreement to ``rel`` of the tensor's largest magnitude (summed gradients carry rounding of that
    size on their small entries)."""
    error = (actual - expected).abs().max().item()
    assert error <= rel * expected.abs().max().item() + 1e-8, f"{name}: max error {error}"


@pytest.mark.parametrize("carrier", ["logits", "embedding"])
@pytest.mark.parametrize("estimator", ["rldf", "sequential"])
def test_loss_and_gradients_equal_brute_force(carrier, estimator):
    model = make_model()
    if carrier == "embedding":  # the carrier's exactness claim: embeddings frozen, as under LoRA
        model.model.decoder.embed_tokens.weight.requires_grad_(False)
    ref_model = reference_model(model)
    args = make_args(estimator)
    ids, mask, output = rollout(model, carrier)
    _, _, exact = rollout(model, "logits")
    assert torch.equal(output.completion_ids, exact.completion_ids)
    advantages = torch.tensor([1.0, -0.5, 0.25])

    loss = DiffusionGemmaRLDFLoss(args)
    model.zero_grad()
    value, batch = loss_under_test(loss, model, ref_model, ids, mask, output, advantages)
    value.backward()
    ours = grads(model)
    assert batch["target_mask"].any() and torch.isfinite(value)
    if estimator == "rldf":  # clean targets were added beyond the accept sets
        assert (batch["target_mask"] & ~batch["state_accept"]).any()

    model.zero_grad()
    expected = reference_loss(model, ref_model, args, ids, mask, output, exact, batch["sampled_steps"], advantages)
    expected.backward()
    theirs = grads(model)
    torch.testing.assert_close(value, expected, atol=2e-6, rtol=1e-5)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert_close_to_scale(ours[name], theirs[name], name)


def test_ppo_loss_and_gradients_equal_brute_force():
    """PPO (``num_iterations > 1``): the ratio to a π_old that differs from the policy, clipped at 1 ± 0.2, with the
    clean targets read from π_old."""
    model = make_model()
    old_model = reference_model(model)
    args = make_args("rldf", beta=0.05)
    ids, mask, output = rollout(model, "logits")
    advantages = torch.tensor([1.0, -0.5, 0.25])
    loss = DiffusionGemmaRLDFLoss(args)
    model.zero_grad()
    value, batch = loss_under_test(loss, model, old_model, ids, mask, output, advantages, old_model=old_model)
    value.backward()
    ours = grads(model)
    ratio = (loss.score_states(model, batch) - batch["old_per_token_logps"]).exp()[batch["target_mask"]]
    assert ((ratio < 0.8) | (ratio > 1.2)).any()  # clipping is exercised
    model.zero_grad()
    expected = reference_loss(model, old_model, args, ids, mask, output, output, batch["sampled_steps"], advantages,
                              old_model=old_model)
    expected.backward()
    torch.testing.assert_close(value, expected, atol=2e-6, rtol=1e-5)
    for name, grad in grads(model).items():
        assert_close_to_scale(ours[name], grad, name)


def test_one_state_per_forward_gives_the_same_loss_and_gradients():
    model = make_model()
    ids, mask, output = rollout(model, "embedding")
    advantages = torch.tensor([1.0, -0.5, 0.25])
    results = []
    for width in (None, 1):
        loss = DiffusionGemmaRLDFLoss(make_args("rldf", beta=0.0), states_per_forward=width)
        model.zero_grad()
        value, batch = loss_under_test(loss, model, None, ids, mask, output, advantages)
        value.backward()
        steps = (batch["sampled_steps"] >= 0).any(0).nonzero().squeeze(1).tolist()
        assert len(loss.loss_chunks(model, batch, steps)) == (1 if width is None else len(steps))
        results.append((value.detach(), grads(model)))
    (one, ours), (split, theirs) = results
    torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-5)
    for name in ours:
        assert_close_to_scale(theirs[name], ours[name], name)


def test_weighted_timesteps_come_from_accepted_log_probs():
    model = make_model()
    ids, mask, output = rollout(model, "embedding")
    loss = DiffusionGemmaRLDFLoss(make_args(num_sampled_timesteps=2, timestep_temperature=0.0))
    trajectory, (total, count) = loss.sample_states(ids, mask, output, None, None)
    record = output.denoising_steps
    accepted = record.accept_mask & record.active.unsqueeze(-1)
    uncertainty = -(record.accepted_logps * accepted).sum(-1) / accepted.sum(-1).clamp_min(1)
    uncertainty = uncertainty.masked_fill(~accepted.any(-1), float("-inf"))
    expected = uncertainty.topk(2, dim=1).indices.sort(1).values  # τ = 0: the two most uncertain steps
    assert torch.equal(trajectory["sampled_steps"], expected)
    assert count == 2 * ids.shape[0]
    # Steps of canvases after a row finished its sequence are never sampled.
    assert record.active.gather(1, trajectory["sampled_steps"]).all()


# -------------------------------------------------------------------------------------------------- trust region
TOP_K = 5


def dppo_args(**overrides) -> DPPOMaskConfig:
    values = dict(max_completion_length=GEN, block_length=CANVAS, num_sampled_timesteps=3, policy_estimator="rldf",
                  clean_target_threshold=0.1, loss_normalization="sample", beta=0.0, use_cpu=True, report_to="none",
                  save_strategy="no", num_generations=3, per_device_train_batch_size=3, divergence_top_k=TOP_K,
                  divergence_threshold=0.05)
    values.update(overrides)
    return DPPOMaskConfig("/tmp/dllm-trl-diffusion-gemma-dppo", **values)


def test_trust_region_on_policy_is_reinforce():
    """On-policy every token's μ is the distribution π_θ recomputes (the rollout's record for accepted tokens, the
    forward's own for clean targets): nothing is masked, the weights are 1, and loss and gradients are REINFORCE's."""
    model = make_model()
    ids, mask, output = rollout(model, "embedding", record_topk=TOP_K)
    args = dppo_args()
    advantages = torch.tensor([1.0, -0.5, 0.25])
    trust = DiffusionGemmaTrustRegionLoss(args, model.config.text_config.vocab_size)
    trust.check_model(model)
    model.zero_grad()
    value, batch = loss_under_test(trust, model, None, ids, mask, output, advantages)
    value.backward()
    ours = grads(model)
    call = trust.begin(batch, trust.normalizer(batch, 1, 1.0), 0.0, 0.2, 0.2)
    steps = (batch["sampled_steps"] >= 0).any(0).nonzero().squeeze(1).tolist()
    with torch.no_grad():
        trust.chunk_loss(model, batch, steps, call)
    metrics = trust.metric_sums(batch, call)
    assert metrics["dppo/masked_frac"][0] == 0 and metrics["dppo/mu_from_rollout"][0] > 0
    assert (call.extra["weights"][batch["target_mask"]] - 1).abs().max() < 1e-5
    model.zero_grad()
    plain, _ = loss_under_test(DiffusionGemmaRLDFLoss(args), model, None, ids, mask, output, advantages)
    plain.backward()
    torch.testing.assert_close(value, plain, atol=1e-6, rtol=1e-5)
    for name, grad in grads(model).items():
        assert_close_to_scale(ours[name], grad, name)


def test_trust_region_divergence_of_accepted_tokens_is_against_the_rollout():
    """After the policy moved, an accepted token's divergence is the top-K KL (SPEC §3.1) of the distribution the
    rollout drew it from against the moved policy's, both recomputed here from the brute-force reference forward."""
    model = make_model()
    ids, mask, output = rollout(model, "logits", record_topk=TOP_K)
    moved = reference_model(model)
    args = dppo_args(policy_estimator="sequential")
    trust = DiffusionGemmaTrustRegionLoss(args, model.config.text_config.vocab_size)
    trajectory, _ = trust.sample_states(ids, mask, output, torch.Generator().manual_seed(7), None)
    batch = dict(trajectory, advantages=torch.tensor([1.0, -0.5, 0.25]))
    batch["target_mask"] = trust.target_mask(batch, None, None)
    call = trust.begin(batch, trust.normalizer(batch, 1, 1.0), 0.0, 0.2, 0.2)
    steps = (batch["sampled_steps"] >= 0).any(0).nonzero().squeeze(1).tolist()
    with torch.no_grad():
        trust.chunk_loss(moved, batch, steps, call)
    record = output.denoising_steps
    checked = 0
    for b in range(ids.shape[0]):
        prompt = ids[b][mask[b].bool()]
        for j, s in enumerate(batch["sampled_steps"][b].tolist()):
            if s < 0:
                continue
            c, temperature = int(record.canvas[s]), record.temperature[s]
            sc = record.self_conditioning[b, s] if bool(record.has_self_conditioning[s]) else None
            with torch.no_grad():
                mu = (reference_logits(model, prompt, output.completion_ids[b], c, record.state_ids[b, s], sc)
                      / temperature).softmax(-1).double()
                pi = (reference_logits(moved, prompt, output.completion_ids[b], c, record.state_ids[b, s], sc)
                      / temperature).softmax(-1).double()
            for i in record.accept_mask[b, s].nonzero().squeeze(1).tolist():
                a = int(record.accepted_ids[b, s, i])
                support = set(mu[i].topk(TOP_K).indices.tolist()) | {a}
                S = torch.tensor(sorted(support))
                mu_tail = (1 - mu[i, S].sum()).clamp_min(1e-12)
                pi_tail = (1 - pi[i, S].sum()).clamp_min(1e-12)
                kl = (mu[i, S] * (mu[i, S] / pi[i, S]).log()).sum() + mu_tail * (mu_tail / pi_tail).log()
                assert abs(call.extra["div"][b, j, i].item() - kl.item()) < 1e-4 * max(1.0, kl.item())
                assert bool(call.extra["from_rollout"][b, j, i])
                checked += 1
    assert checked > 0
    assert (~call.extra["keep"] & batch["target_mask"]).any()  # the moved policy left the trust region somewhere


def test_dppo_trainer_step_runs():
    model, tokenizer = toy_model()
    args = DPPOMaskConfig("/tmp/dllm-trl-diffusion-gemma-dppo-trainer", max_completion_length=8, block_length=4,
                          num_generations=4, per_device_train_batch_size=4, max_steps=1, use_cpu=True,
                          report_to="none", save_strategy="no", num_sampled_timesteps=3, divergence_top_k=4,
                          drop_zero_variance_groups=False, logging_steps=1)
    sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=4))
    trainer = DiffusionDPPOMaskTrainer(model=model, reward_funcs=digit_ones_reward, args=args,
                                       train_dataset=toy_dataset("train"), processing_class=tokenizer, sampler=sampler,
                                       loss=DiffusionGemmaTrustRegionLoss(args, model.config.text_config.vocab_size))
    assert sampler.config.record_topk == 4  # the loss asked the sampler for the behaviour top-K
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert any(name.startswith("dppo/") for name in logs[0])


# ------------------------------------------------------------------------------------------------------ trainer
def digit_ones_reward(completions, **kwargs):
    """A reward that varies between completions of a random model: how many distinct characters they hold."""
    return [len(set(text)) / 10 for text in completions]


def toy_model():
    tokenizer = build_toy_tokenizer()
    model = build_tiny_diffusion_gemma(vocab_size=len(tokenizer) + 3, canvas_length=4,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.model.decoder.norm.weight.add_(20.0)
    return model, tokenizer


def train(carrier: str, steps: int = 2):
    model, tokenizer = toy_model()
    model.model.decoder.embed_tokens.weight.requires_grad_(False)
    args = RLDFConfig("/tmp/dllm-trl-diffusion-gemma-trainer", max_completion_length=8, block_length=4,
                      num_generations=4, per_device_train_batch_size=4, max_steps=steps, use_cpu=True,
                      report_to="none", save_strategy="no", beta=0.02, num_sampled_timesteps=3, learning_rate=1e-1,
                      optim="sgd", drop_zero_variance_groups=False, logging_steps=1)  # SGD: Adam's first step
    # is lr·sign(g) and would turn float rounding of near-zero gradients into whole steps
    sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=4,
                                                                self_conditioning=carrier))
    trainer = RLDFTrainer(model=model, reward_funcs=digit_ones_reward, args=args, train_dataset=toy_dataset("train"),
                          processing_class=tokenizer, sampler=sampler, loss=DiffusionGemmaRLDFLoss(args))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    return trainer, before


def test_trainer_steps_and_carriers_agree():
    two_steps, before = train("embedding")
    logs = [h for h in two_steps.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all(h["grad_norm"] > 0 for h in logs)
    assert any(not torch.equal(before[n], p.detach()) for n, p in two_steps.model.named_parameters())
    # One step of each carrier from the same rollout: the same update. (Over more steps a rollout can branch on
    # float rounding — a draw or an accept set at a boundary — so later steps are not compared.)
    embedding, _ = train("embedding", steps=1)
    after = dict(embedding.model.named_parameters())
    logits, _ = train("logits", steps=1)
    for name, param in logits.model.named_parameters():
        torch.testing.assert_close(param.detach(), after[name].detach(), atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------- refusals
def trainer_for(model, args, tokenizer, **kwargs):
    return RLDFTrainer(model=model, reward_funcs=digit_ones_reward, args=args, train_dataset=toy_dataset("train"),
                       processing_class=tokenizer, **kwargs)


def toy_args(**overrides):
    values = dict(max_completion_length=8, block_length=4, num_generations=4, per_device_train_batch_size=4,
                  use_cpu=True, report_to="none", save_strategy="no")
    values.update(overrides)
    return RLDFConfig("/tmp/dllm-trl-diffusion-gemma-refusals", **values)


def test_masked_diffusion_settings_are_refused_early():
    model, tokenizer = toy_model()
    sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=2))
    with pytest.raises(ValueError, match=r"block_length=8 .*set block_length=4"):
        args = toy_args(max_completion_length=8, block_length=8)
        trainer_for(model, args, tokenizer, sampler=sampler, loss=DiffusionGemmaRLDFLoss(args))
    with pytest.raises(ValueError, match=r"unmasking_threshold=0.5 .*entropy_bound"):
        args = toy_args(unmasking_threshold=0.5)
        trainer_for(model, args, tokenizer, sampler=sampler, loss=DiffusionGemmaRLDFLoss(args))
    with pytest.raises(ValueError, match=r"policy_estimator='all_masking'.*\('rldf', 'sequential'\)"):
        args = toy_args(policy_estimator="all_masking")
        trainer_for(model, args, tokenizer, sampler=sampler, loss=DiffusionGemmaRLDFLoss(args))
    with pytest.raises(ValueError, match="RLDFLoss scores masked-diffusion states.*no config.mask_token_id"):
        args = toy_args()
        trainer_for(model, args, tokenizer, sampler=sampler, loss=RLDFLoss(args))  # a masked-diffusion loss
    with pytest.raises(ValueError, match="no config.mask_token_id.*DiffusionGemmaSampler"):
        args = toy_args()
        trainer_for(model, args, tokenizer, loss=DiffusionGemmaRLDFLoss(args),  # a masked-diffusion sampler
                    sampler=MaskedDiffusionSampler(args.diffusion_generation_config(block_length=4)))
    masked = copy.deepcopy(model)
    masked.config.mask_token_id = 5  # as set_diffusion_properties would leave it
    with pytest.raises(ValueError, match=r"config.mask_token_id=5 .*no mask token"):
        args = toy_args()
        trainer_for(masked, args, tokenizer, sampler=sampler, loss=DiffusionGemmaRLDFLoss(args))
    with pytest.raises(ValueError, match="MaskedDiffusionSampler"):
        DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8)).check_model(
            set_diffusion_properties(make_masked_llada(), mask_token_id=3))
    with pytest.raises(ValueError, match="DiffusionGemmaSampler"):
        MaskedDiffusionSampler(toy_args().diffusion_generation_config(block_length=4)).check_model(model)
    with pytest.raises(ValueError, match="no config.mask_token_id"):
        RLDFLoss(toy_args()).check_model(model)


def test_trust_region_trainers_take_the_diffusion_gemma_pieces_from_its_family():
    """DPPOMaskTrainer ("auto") and DiffusionDPPOMaskTrainer build DiffusionGemma's own trust-region loss and sampler
    with nothing named; the causal kind is refused, naming the family."""
    model, tokenizer = toy_model()
    for trainer_class in (DPPOMaskTrainer, DiffusionDPPOMaskTrainer):
        args = dppo_args(max_completion_length=8, block_length=None, num_generations=4, per_device_train_batch_size=4)
        trainer = trainer_class(model=model, reward_funcs=digit_ones_reward, args=args,
                                train_dataset=toy_dataset("train"), processing_class=tokenizer)
        assert type(trainer) is DiffusionDPPOMaskTrainer and trainer.block_length == model.config.canvas_length
        assert type(trainer.loss) is DiffusionGemmaTrustRegionLoss and type(trainer.sampler) is DiffusionGemmaSampler
        assert trainer.sampler.config.gen_length == 8 and trainer.sampler.config.record_topk == args.divergence_top_k
    args = dppo_args(max_completion_length=8, block_length=None, num_generations=4, per_device_train_batch_size=4,
                     model_kind="causal")
    with pytest.raises(ValueError, match="model_kind='causal' but the model is a diffusion LM .family 'diffusion_gemma'"):
        DPPOMaskTrainer(model=model, reward_funcs=digit_ones_reward, args=args, train_dataset=toy_dataset("train"),
                        processing_class=tokenizer)


def test_sampler_length_other_than_max_completion_length_is_refused():
    model, tokenizer = toy_model()
    args = toy_args(max_completion_length=8)
    short = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=4, max_denoising_steps=2))
    with pytest.raises(ValueError, match=r"gen_length=4 differs from max_completion_length=8"):
        trainer_for(model, args, tokenizer, sampler=short, loss=DiffusionGemmaRLDFLoss(args))


def make_masked_llada():
    from tests.tiny_models import build_tiny_llada

    return build_tiny_llada()


def test_loader_recognises_diffusion_gemma(tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    loaded = load_diffusion_model(str(tmp_path))
    assert type(loaded).__name__ == "DiffusionGemmaForBlockDiffusion"
    assert getattr(loaded.config, "mask_token_id", None) is None
    reference = model.state_dict()
    assert all(torch.equal(reference[name], value) for name, value in loaded.state_dict().items())
    with pytest.raises(ValueError, match=r"mask_token_id=3.*load_diffusion_model\(path\)"):
        load_diffusion_model(str(tmp_path), mask_token_id=3)
    with pytest.raises(ValueError, match="block_size=4"):
        load_diffusion_model(str(tmp_path), block_size=4)


# ---------------------------------------------------------------------------------------------------------- LoRA
LORA_TARGETS = r".*(language_model|decoder)\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"


def lora_model():
    from peft import LoraConfig, get_peft_model

    from dllm_trl.models.diffusion_gemma import tie_encoder_adapters

    model, tokenizer = toy_model()
    torch.manual_seed(0)  # the adapters' initial draws: the same in every call, whatever ran before
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    assert tie_encoder_adapters(peft_model) == 2 * 4 - 1  # q, k, o in both layers; v in the sliding layer only
    return peft_model, tokenizer


def train_lora(carrier: str):
    model, tokenizer = lora_model()
    args = RLDFConfig("/tmp/dllm-trl-diffusion-gemma-lora", max_completion_length=8, block_length=4,
                      num_generations=4, per_device_train_batch_size=4, max_steps=1, use_cpu=True, report_to="none",
                      save_strategy="no", beta=0.02, num_sampled_timesteps=3, learning_rate=1.0, optim="sgd",
                      drop_zero_variance_groups=False, logging_steps=1, bf16=False)  # float32 forwards: the carriers
    # agree to rounding there, while under bf16 autocast the "logits" carrier's soft embedding is recomputed in bf16
    sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=4,
                                                                self_conditioning=carrier))
    trainer = RLDFTrainer(model=model, reward_funcs=digit_ones_reward, args=args, train_dataset=toy_dataset("train"),
                          processing_class=tokenizer, sampler=sampler, loss=DiffusionGemmaRLDFLoss(args))
    trainer.train()
    return trainer.model, sampler


def test_lora_training_tied_adapters_and_merge():
    model, sampler = train_lora("embedding")
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # the adapters trained
    encoder_q = model.get_submodule("base_model.model.model.encoder.language_model.layers.0.self_attn.q_proj")
    decoder_q = model.get_submodule("base_model.model.model.decoder.layers.0.self_attn.q_proj")
    assert encoder_q.lora_A is decoder_q.lora_A  # still one adapter per shared weight
    # Under LoRA the embeddings are frozen: the embedding carrier is exact, both carriers train the same adapters.
    other, _ = train_lora("logits")
    for name, param in other.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(param.detach(), adapters[name], atol=1e-6, rtol=1e-5, msg=name)

    from dllm_trl.models.diffusion_gemma import merge_tied_adapters

    def reloaded():  # a fresh tied LoRA model holding the trained adapters (the trainer's model carries its wrappers)
        fresh, _ = lora_model()
        missing = fresh.load_state_dict({n: p for n, p in model.state_dict().items() if ".default." in n}, strict=False)
        assert not missing.unexpected_keys
        return fresh.eval()

    prompt = torch.tensor([[5, 6, 7, 8]])
    torch.manual_seed(3)
    adapted = sampler(model, prompt)
    naive = reloaded().merge_and_unload()  # PEFT's merge: both deltas into the one shared weight
    merged = merge_tied_adapters(reloaded())
    assert type(merged).__name__ == "DiffusionGemmaForBlockDiffusion"
    torch.manual_seed(3)
    again = sampler(merged, prompt)
    assert torch.equal(again.sequences, adapted.sequences)
    torch.testing.assert_close(again.denoising_steps.accepted_logps, adapted.denoising_steps.accepted_logps,
                               atol=1e-5, rtol=1e-5)
    torch.manual_seed(3)
    wrong = sampler(naive, prompt)
    assert not torch.allclose(wrong.denoising_steps.accepted_logps[:, :1], adapted.denoising_steps.accepted_logps[:, :1],
                              atol=1e-4)


def test_peft_config_given_to_the_trainer_gets_tied_adapters(tmp_path):
    """``RLDFTrainer(..., peft_config=LoraConfig(...))``: TRL adds the adapters inside the trainer, after the loss
    prepared the model; the loss ties them there too (else encoder and decoder adapters of one shared weight would
    train apart, silently), and the trained adapters save. Targeting only the encoder's modules is refused."""
    from peft import LoraConfig

    def trainer_with(target_modules):
        model, tokenizer = toy_model()
        args = RLDFConfig(str(tmp_path / "run"), max_completion_length=8, block_length=4, num_generations=4,
                          per_device_train_batch_size=4, max_steps=1, use_cpu=True, report_to="none",
                          save_strategy="no", num_sampled_timesteps=2, bf16=False, logging_steps=1,
                          learning_rate=1e-2, drop_zero_variance_groups=False)  # adapters far from zero in one step
        sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=3))
        return RLDFTrainer(model=model, reward_funcs=digit_ones_reward, args=args,
                           train_dataset=toy_dataset("train", size=16), processing_class=tokenizer, sampler=sampler,
                           loss=DiffusionGemmaRLDFLoss(args),
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))

    trainer = trainer_with(LORA_TARGETS)
    modules = dict(trainer.model.named_modules())
    pairs = [(name, modules[name.replace("encoder.language_model.layers", "decoder.layers")])
             for name, module in modules.items()
             if ".encoder.language_model.layers." in name and hasattr(module, "lora_A")]
    assert len(pairs) == 2 * 4 - 1 and all(modules[name].lora_A is twin.lora_A for name, twin in pairs)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "adapter_config.json").is_file()
    # Loading the saved adapter merges each shared weight's delta once: the merged model decodes as the trained one.
    from dllm_trl.families import load_adapter

    merged = load_adapter(toy_model()[0], str(tmp_path / "saved")).eval()
    assert type(merged).__name__ == "DiffusionGemmaForBlockDiffusion"
    sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=3))
    prompt = torch.tensor([[5, 6, 7, 8]])
    outputs = []
    for model in (trainer.model.eval(), merged):
        torch.manual_seed(3)
        outputs.append(sampler(model, prompt))
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    torch.testing.assert_close(outputs[1].denoising_steps.accepted_logps, outputs[0].denoising_steps.accepted_logps,
                               atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match="decoder twin is not"):
        trainer_with(r".*language_model\.layers\.\d+\.self_attn\.q_proj")
    with pytest.raises(ValueError, match="task_type=None"):
        model, tokenizer = toy_model()
        args = RLDFConfig(str(tmp_path / "run"), max_completion_length=8, block_length=4, use_cpu=True,
                          report_to="none", bf16=False)
        RLDFTrainer(model=model, reward_funcs=digit_ones_reward, args=args, train_dataset=toy_dataset("train", size=8),
                    processing_class=tokenizer, loss=DiffusionGemmaRLDFLoss(args),
                    sampler=DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=3)),
                    peft_config=LoraConfig(r=4, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
