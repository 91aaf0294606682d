"""DiffusionGemma's rollout (uniform-noise block diffusion, SPEC §8) against transformers' own ``model.generate``.

Oracles: (a) under the same global random state the sampler returns ``generate``'s sequences token for token and
leaves the global generator where ``generate`` leaves it (so it drew the same numbers in the same order) — several
prompt lengths in a left-padded batch, three canvases, rows that stop early inside a canvas, rows that finish their
sequence at an EOS (later canvases padding), batch 1 and 3; (b) replaying a recorded step (the encoder over the
prompt and the finished canvases, the decoder over the recorded canvas and self-conditioning input) gives the
log-probs of the accepted tokens the rollout recorded, under both self-conditioning carriers; (c) the record is
self-consistent: accepted tokens are the next canvas's tokens there, and each canvas's output is the argmax of the
row's last step.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

from dllm_trl.generation.diffusion_gemma import (
    DiffusionGemmaSampler,
    DiffusionGemmaSamplerConfig,
    entropy_bound_accept,
    replay_logits,
)
from tests.tiny_models import build_tiny_diffusion_gemma

EOS = 63
PAD = 0
STEPS = 6
CANVAS = 8
GEN = 3 * CANVAS
SETTINGS = dict(max_denoising_steps=STEPS, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.5)


def make_model(seed: int = 0):
    """A tiny DiffusionGemma whose final norm is scaled up, so that its predictions are confident enough for the entropy
    bound to accept several positions per step and for rows to stop early."""
    model = build_tiny_diffusion_gemma(seed=seed, canvas_length=CANVAS)
    with torch.no_grad():
        model.model.decoder.norm.weight.add_(49.0)
    return model


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]


def sampler(carrier: str = "embedding") -> DiffusionGemmaSampler:
    return DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=GEN, entropy_bound=0.5, eos_token_id=EOS,
                                                             pad_token_id=PAD, self_conditioning=carrier, **SETTINGS))


def reference(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=GEN, eos_token_id=EOS, pad_token_id=PAD,
                          sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.5), **SETTINGS).sequences


def steps_per_canvas(output):
    record = output.denoising_steps
    canvases = int(record.canvas.max()) + 1
    return [[int(record.active[b, record.canvas == c].sum()) for c in range(canvases)]
            for b in range(record.active.shape[0])]


@pytest.mark.parametrize("batch", [1, 3])
def test_token_for_token_equal_to_generate(batch):
    model = make_model()
    ids, mask = left_padded(PROMPTS)
    ids, mask = ids[:batch], mask[:batch]
    early_stops = finished_rows = 0
    for seed in range(4):
        torch.manual_seed(seed)
        expected = reference(model, ids, mask)
        after_reference = torch.get_rng_state()
        torch.manual_seed(seed)
        output = sampler()(model, ids, mask)
        assert torch.equal(torch.get_rng_state(), after_reference), "the sampler drew other random numbers"
        width = expected.shape[1]
        assert torch.equal(output.sequences[:, :width], expected)
        assert (output.sequences[:, width:] == PAD).all()  # canvases generate never ran: padding
        counts = steps_per_canvas(output)
        early_stops += sum(0 < n < STEPS for row in counts for n in row)
        finished_rows += sum(0 in row for row in counts)
    # The cases the oracle must cover did happen: early stops inside a canvas, sequences finished at an EOS.
    assert early_stops > 0
    if batch == 3:
        assert finished_rows > 0


def test_record_is_consistent():
    model = make_model()
    ids, mask = left_padded(PROMPTS)
    torch.manual_seed(0)
    output = sampler()(model, ids, mask)
    record = output.denoising_steps
    # The accepted tokens are the next step's canvas there (within a canvas, for rows still denoising).
    same_canvas = record.canvas[1:] == record.canvas[:-1]
    both = record.active[:, 1:] & record.active[:, :-1] & same_canvas.unsqueeze(0)
    accepted = record.accept_mask[:, :-1] & both.unsqueeze(-1)
    assert accepted.any()
    assert torch.equal(record.state_ids[:, 1:][accepted], record.accepted_ids[:, :-1][accepted])
    assert (record.accepted_logps[record.accept_mask] <= 0).all()
    assert (record.accepted_logps[~record.accept_mask] == 0).all()
    # Temperatures fall linearly from t_max to t_min within each canvas.
    first = record.temperature[record.canvas == 0]
    assert torch.allclose(first, torch.linspace(0.8, 0.4 + 0.4 / STEPS, STEPS), atol=1e-6)
    # Each position's commit step is its canvas's last active step; steps are counted per row.
    assert torch.equal(output.num_steps, record.active.sum(1))
    assert (output.completion_mask.sum(1) >= 1).all()


@pytest.mark.parametrize("carrier", ["embedding", "logits"])
def test_replayed_steps_reproduce_the_recorded_distribution(carrier):
    model = make_model()
    ids, mask = left_padded(PROMPTS)
    torch.manual_seed(1)
    output = sampler(carrier)(model, ids, mask)
    record = output.denoising_steps
    # Every active step of every row, replayed in one call (states of different canvases and rows together).
    rows, steps = record.active.nonzero(as_tuple=True)
    slots = max(int(record.active.sum(1).max()), 1)
    canvas = torch.full((ids.shape[0], slots), -1)
    chosen = torch.zeros(ids.shape[0], slots, dtype=torch.long)
    for b in range(ids.shape[0]):
        active = record.active[b].nonzero().squeeze(1)
        canvas[b, : active.numel()] = record.canvas[active]
        chosen[b, : active.numel()] = active
    b_index = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(chosen)
    with torch.no_grad():
        logits = replay_logits(model, ids, mask, output.completion_ids, canvas, record.state_ids[b_index, chosen],
                               record.self_conditioning[b_index, chosen],
                               record.has_self_conditioning[chosen], record.carrier)
    r, j = (canvas >= 0).nonzero(as_tuple=True)
    s = chosen[r, j]
    scaled = logits / record.temperature[s].view(-1, 1, 1)
    logps = torch.log_softmax(scaled, -1).gather(-1, record.accepted_ids[r, s].unsqueeze(-1)).squeeze(-1)
    accept = record.accept_mask[r, s]
    assert accept.any()
    torch.testing.assert_close(logps[accept], record.accepted_logps[r, s][accept], atol=2e-5, rtol=1e-5)
    # The accept set is a function of the logits: the replay's equals the rollout's.
    assert torch.equal(entropy_bound_accept(scaled, 0.5), accept)
    if carrier == "logits":  # the next step's self-conditioning input is this step's tempered logits: all of them
        last = record.canvas.numel() - 1
        after = (s + 1).clamp(max=last)
        following = (s < last) & (record.canvas[after] == record.canvas[s]) & record.active[r, after]
        assert following.any()
        torch.testing.assert_close(scaled[following], record.self_conditioning[r[following], after[following]],
                                   atol=1e-4, rtol=1e-5)


def test_sampler_refuses_partial_canvases_and_other_models():
    model = make_model()
    bad = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=CANVAS + 3, **SETTINGS))
    with pytest.raises(ValueError, match="canvas_length=8"):
        bad.check_model(model)
    from tests.tiny_models import build_tiny_llada

    with pytest.raises(ValueError, match="MaskedDiffusionSampler"):
        sampler().check_model(build_tiny_llada())
