"""DiffusionGemma's gradient through the self-conditioning chain (``DiffusionGemmaRLDFLoss(args,
self_conditioning_gradient="chain")``) against the default, which holds the rollout's self-conditioning input fixed.

Oracle: a brute-force loss written here — one state at a time, each row alone and unpadded (the reference forwards of
``test_diffusion_gemma_training``), the self-conditioning input of a sampled step ``n`` recomputed by hand: the
canvas's first step decoded with zeros, each later step with the tempered logits ``logits / T`` of the step before,
up to ``n``. Autograd of that sum is the chain gradient; the same sum with each input detached is the gradient the
default claims (the recorded input held fixed). The two differ where the self-conditioning matters, and at the
rollout's weights the chain's forward reproduces the recorded one.
"""

from __future__ import annotations


import pytest
import torch

from dllm_trl.losses.diffusion_gemma_loss import DiffusionGemmaRLDFLoss

from .test_diffusion_gemma_training import (
    CANVAS, assert_close_to_scale, grads, loss_under_test, make_args, make_model, reference_logits, reference_model,
    rollout,
)


def chain_logits(model, prompt, completion, record, row, step, detach, chain_model=None):
    """Logits of ``model`` at record step ``step`` of ``row``, its self-conditioning input recomputed by
    ``chain_model`` (default ``model``) from the canvas's first step (zeros) through every step before it; ``detach``:
    each input a constant (the frozen chain)."""
    canvas = int(record.canvas[step])
    first = int((record.canvas == canvas).nonzero()[0])
    sc = None
    for t in range(first, step):
        logits = reference_logits(chain_model or model, prompt, completion, canvas, record.state_ids[row, t], sc)
        sc = logits / record.temperature[t]
        sc = sc.detach() if detach else sc
    return reference_logits(model, prompt, completion, canvas, record.state_ids[row, step], sc)


def chain_reference_loss(model, ref_model, args, ids, mask, output, sampled, advantages, detach):
    """Σ_rows Σ_{n sampled} of REINFORCE's per-token terms ``−A log π_θ(y | x_n, sc_n, T_n)`` (plus β · k3 KL to
    ``ref_model``) over the targets, with the ``sample`` normalisation; ``sc_n`` from :func:`chain_logits`. The
    reference reads its own chain, or with ``detach`` the policy's (the recorded input both are fed by default)."""
    record = output.denoising_steps
    rows = ids.shape[0]
    total = 0.0
    for b in range(rows):
        prompt, completion = ids[b][mask[b].bool()], output.completion_ids[b]
        steps = [int(s) for s in sampled[b] if s >= 0]
        for s in steps:
            c, temperature = int(record.canvas[s]), record.temperature[s]
            accept = record.accept_mask[b, s]
            final = completion[c * CANVAS : (c + 1) * CANVAS]
            target = torch.where(accept, record.accepted_ids[b, s], final).unsqueeze(-1)
            logps = (chain_logits(model, prompt, completion, record, b, s, detach) / temperature).log_softmax(-1)
            token_logps = logps.gather(-1, target).squeeze(-1)
            targets = accept.clone()
            if args.policy_estimator == "rldf":
                valid = output.completion_mask[b, c * CANVAS : (c + 1) * CANVAS].bool()
                targets |= valid & (token_logps.detach().exp() >= args.clean_target_threshold)
            terms = -advantages[b] * token_logps
            if args.beta:
                with torch.no_grad():
                    ref = chain_logits(ref_model, prompt, completion, record, b, s, True,
                                       chain_model=model if detach else None) / temperature
                    ref = ref.log_softmax(-1).gather(-1, target).squeeze(-1)
                delta = ref - token_logps
                terms = terms + args.beta * (delta.exp() - delta - 1)
            total = total + (terms * targets).sum() / (targets.sum() * len(steps) * rows)
    return total


def loss_and_grads(model, loss, ref_model, ids, mask, output, advantages):
    model.zero_grad()
    value, batch = loss_under_test(loss, model, ref_model, ids, mask, output, advantages)
    value.backward()
    return value.detach(), grads(model), batch


def reference_and_grads(model, ref_model, args, ids, mask, output, sampled, advantages, detach):
    model.zero_grad()
    value = chain_reference_loss(model, ref_model, args, ids, mask, output, sampled, advantages, detach)
    value.backward()
    return value.detach(), grads(model)


def relative_difference(ours: dict, theirs: dict) -> float:
    """‖ours − theirs‖ / ‖theirs‖ over all gradients as one vector."""
    a = torch.cat([ours[n].flatten() for n in sorted(ours)])
    b = torch.cat([theirs[n].flatten() for n in sorted(ours)])
    return float((a - b).norm() / b.norm())


ADVANTAGES = torch.tensor([1.0, -0.5, 0.25])


def sc_model(scale: float = 8.0):
    """The tests' tiny DiffusionGemma with its self-conditioning block's output scaled up, so that the input it reads
    from the step before moves the logits (at random initialisation it barely does)."""
    model = make_model()
    with torch.no_grad():
        model.model.decoder.self_conditioning.down_proj.weight.mul_(scale)
    return model


def late_steps_args(estimator, beta):
    """k = 3 of each row's steps, the latest ones (τ → 0 on a ramp of uncertainty is not controllable, so the
    sampling temperature is large: the draw is near-uniform, seeded)."""
    return make_args(estimator, beta=beta, num_sampled_timesteps=3, timestep_temperature=100.0)


@pytest.mark.parametrize("carrier, estimator, beta", [("logits", "sequential", 0.0), ("embedding", "rldf", 0.05)])
def test_chain_gradient_equals_the_hand_written_chain(carrier, estimator, beta):
    """(a) The chain option: loss and every gradient = autograd of the explicit sum with the chain recomputed by hand.
    (b) The default: = the same sum with each self-conditioning input detached (the frozen chain)."""
    model = sc_model()
    if carrier == "embedding":  # the recorded soft embedding also holds E fixed: exact with frozen embeddings (LoRA)
        model.model.decoder.embed_tokens.weight.requires_grad_(False)
    ref_model = reference_model(model)
    args = late_steps_args(estimator, beta)
    ids, mask, output = rollout(model, carrier)
    sampled_depth = []
    results = {}
    for mode in ("chain", "recorded"):
        loss = DiffusionGemmaRLDFLoss(args, self_conditioning_gradient=mode)
        value, ours, batch = loss_and_grads(model, loss, ref_model, ids, mask, output, ADVANTAGES)
        expected, theirs = reference_and_grads(model, ref_model, args, ids, mask, output, batch["sampled_steps"],
                                               ADVANTAGES, detach=mode == "recorded")
        torch.testing.assert_close(value, expected, atol=2e-6, rtol=1e-5)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert_close_to_scale(ours[name], theirs[name], f"{mode}: {name}")
        results[mode] = ours
        sampled_depth.append(batch["sampled_steps"])
    assert torch.equal(*sampled_depth)  # both sampled the same steps (same generator)
    record = output.denoising_steps
    has_sc = record.has_self_conditioning[sampled_depth[0].clamp_min(0)] & (sampled_depth[0] >= 0)
    assert has_sc.sum() >= 3  # several sampled steps are deep enough for the chain to matter
    # (c) and the two gradients differ.
    assert relative_difference(results["chain"], results["recorded"]) > 0.05  # the tolerance above is 1e-4


def test_chain_forward_equals_the_recorded_forward_at_the_rollout_policy():
    """At π_old (θ = the rollout's weights) the recomputed self-conditioning input is the recorded one, so both
    options score every sampled state's targets alike (float noise only), for both carriers."""
    model = sc_model()
    for carrier in ("logits", "embedding"):
        ids, mask, output = rollout(model, carrier)
        scores = []
        for mode in ("recorded", "chain"):
            loss = DiffusionGemmaRLDFLoss(late_steps_args("rldf", 0.0), self_conditioning_gradient=mode)
            trajectory, _ = loss.sample_states(ids, mask, output, torch.Generator().manual_seed(7), None)
            with torch.no_grad():
                scores.append(loss.score_states(model, trajectory))
        live = trajectory["sampled_steps"] >= 0
        assert live.sum() >= 6
        torch.testing.assert_close(scores[1][live], scores[0][live], atol=1e-5, rtol=1e-5)
        # The accepted tokens' log-probs are the rollout's own.
        accept = trajectory["state_accept"]
        torch.testing.assert_close(scores[1][accept], trajectory["state_rollout_logps"][accept], atol=1e-5, rtol=1e-5)


def test_chain_option_is_validated():
    with pytest.raises(ValueError, match="self_conditioning_gradient='full'"):
        DiffusionGemmaRLDFLoss(make_args(), self_conditioning_gradient="full")
    model = make_model()
    ids, mask, output = rollout(model, "logits")
    recorded = DiffusionGemmaRLDFLoss(make_args())
    trajectory, _ = recorded.sample_states(ids, mask, output, torch.Generator().manual_seed(7), None)
    chain = DiffusionGemmaRLDFLoss(make_args(), self_conditioning_gradient="chain")
    with pytest.raises(ValueError, match=r"self_conditioning_gradient='chain'.*chain_state_ids"):
        chain.score_states(model, trajectory)


def test_trust_region_loss_takes_the_chain_option():
    """The trust-region loss scores through the same replay: at the rollout's weights its old-policy pass (log-probs
    and top-K) reads the same under both options; the option is validated there too."""
    from dllm_trl.losses.diffusion_gemma_loss import DiffusionGemmaTrustRegionLoss

    from .test_diffusion_gemma_training import TOP_K, dppo_args

    model = sc_model()
    vocab = model.config.text_config.vocab_size
    with pytest.raises(ValueError, match="self_conditioning_gradient="):
        DiffusionGemmaTrustRegionLoss(dppo_args(), vocab, self_conditioning_gradient="detached")
    ids, mask, output = rollout(model, "logits", record_topk=TOP_K)
    passes = []
    for mode in ("recorded", "chain"):
        loss = DiffusionGemmaTrustRegionLoss(dppo_args(), vocab, self_conditioning_gradient=mode)
        trajectory, _ = loss.sample_states(ids, mask, output, torch.Generator().manual_seed(7), None)
        passes.append(loss.score_for_policy_pass(model, trajectory, old_pass=True))
    (logps, extra), (chain_logps, chain_extra) = passes
    torch.testing.assert_close(chain_logps, logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chain_extra["old_topk_logps"], extra["old_topk_logps"], atol=1e-5, rtol=1e-5)
