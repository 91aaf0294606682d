"""The final-state term of DiffusionGemma (issue 33, item 4): re-noised final canvases scored as the model's own
forward scores them, one unpadded row at a time."""

from __future__ import annotations

import pytest
import torch

from dllm_trl.losses.diffusion_gemma_final_state import (
    final_state_logps,
    final_state_policy_loss,
    final_state_states,
)

from .test_diffusion_gemma_training import CANVAS, make_model, reference_logits, rollout

T_MIN, T_MAX = 0.4, 0.8


def states_for(output, model, num_states=3, seed=0):
    return final_state_states(output.completion_ids, output.completion_mask, CANVAS, num_states,
                              model.config.get_text_config().vocab_size, T_MIN, T_MAX,
                              torch.Generator().manual_seed(seed))


def reference_loss(model, ids, mask, output, states, advantages):
    """The same loss from the model's own forward: per row and state, the unpadded prompt and the final canvases
    before the state's one encoded, the decoder on the re-noised canvas with no self-conditioning."""
    total, count = 0.0, states["state_valid"].sum()
    values = torch.zeros(states["state_ids"].shape)
    for b in range(ids.shape[0]):
        prompt = ids[b][mask[b].bool()]
        for j in range(states["state_ids"].shape[1]):
            logits = reference_logits(model, prompt, output.completion_ids[b], int(states["state_canvas"][b, j]),
                                      states["state_ids"][b, j], None)
            logps = (logits / states["state_temperature"][b, j]).log_softmax(-1)
            picked = logps.gather(-1, states["target_ids"][b, j].unsqueeze(-1)).squeeze(-1)
            picked = torch.where(states["state_valid"][b, j], picked, 0.0)
            values[b, j] = picked.detach()
            total = total - advantages[b] * picked.sum()
    return total / count, values


def test_logps_loss_and_gradients_equal_the_models_own_forward():
    model = make_model()
    ids, mask, output = rollout(model, "embedding")
    assert (output.completion_mask.sum(-1) > CANVAS).any()  # some row reaches its second canvas
    states = states_for(output, model, num_states=4)
    assert (states["state_canvas"] == 1).any()
    advantages = torch.tensor([1.0, -0.5, 0.25])

    logps = final_state_logps(model, ids, mask, output.completion_ids, states)
    loss = final_state_policy_loss(logps, states["state_valid"], advantages)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    expected, expected_values = reference_loss(model, ids, mask, output, states, advantages)
    expected.backward()

    torch.testing.assert_close(logps.detach(), expected_values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-6, rtol=1e-5)
    assert grads, "no gradient reached the model"
    for name, param in model.named_parameters():
        if param.grad is None:
            assert name not in grads
            continue
        scale = param.grad.abs().max().clamp_min(1e-8)
        assert (grads[name] - param.grad).abs().max() <= 1e-4 * scale, name


def test_states_renoise_the_final_canvas_with_uniform_tokens():
    vocab, rows = 50, 3
    completion = torch.randint(0, vocab, (rows, 2 * CANVAS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(completion, dtype=torch.bool)
    mask[0, 3:] = False  # EOS in the first canvas: never the second
    states = final_state_states(completion, mask, CANVAS, 4000, vocab, T_MIN, T_MAX, torch.Generator().manual_seed(2))

    assert (states["state_canvas"][0] == 0).all()
    assert set(states["state_canvas"][1:].unique().tolist()) == {0, 1}
    columns = states["state_canvas"].unsqueeze(-1) * CANVAS + torch.arange(CANVAS)
    final = torch.stack([completion[b][columns[b]] for b in range(rows)])
    assert torch.equal(states["target_ids"], final)
    assert torch.equal(states["state_valid"], torch.stack([mask[b][columns[b]] for b in range(rows)]))
    kept = ~states["state_noised"]
    assert torch.equal(states["state_ids"][kept], final[kept])
    # The share of re-drawn positions follows the noise level; the re-drawn tokens are uniform over the vocabulary.
    level = states["noise_level"]
    low, high = level < 0.2, level > 0.8
    assert states["state_noised"][low].float().mean() < 0.15 and states["state_noised"][high].float().mean() > 0.85
    drawn = states["state_ids"][states["state_noised"]]
    counts = torch.bincount(drawn, minlength=vocab).float()
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()
    torch.testing.assert_close(states["state_temperature"], T_MIN + (T_MAX - T_MIN) * level)
    again = final_state_states(completion, mask, CANVAS, 4000, vocab, T_MIN, T_MAX, torch.Generator().manual_seed(2))
    assert all(torch.equal(states[key], again[key]) for key in states)


def test_bad_inputs_are_refused_with_the_fix():
    completion = torch.zeros(2, 2 * CANVAS, dtype=torch.long)
    mask = torch.ones_like(completion)
    with pytest.raises(ValueError, match="not a whole number of canvases"):
        final_state_states(completion[:, :-1], mask[:, :-1], CANVAS, 2, 10, T_MIN, T_MAX)
    with pytest.raises(ValueError, match="num_states=0"):
        final_state_states(completion, mask, CANVAS, 0, 10, T_MIN, T_MAX)
    with pytest.raises(ValueError, match="t_min"):
        final_state_states(completion, mask, CANVAS, 2, 10, 0.8, 0.4)
    model = make_model()
    states = final_state_states(completion, mask, CANVAS // 2, 2, 10, T_MIN, T_MAX)
    with pytest.raises(ValueError, match="canvas_length"):
        final_state_logps(model, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), completion, states)
