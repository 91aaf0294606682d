"""A DiffusionGemma policy-gradient term that needs only the rollout's final state (issue 33, item 4).

An inference engine such as vLLM returns each DiffusionGemma completion (the argmax canvases it committed) and the
converging step's log-probs, not the per-step record (``x_n``, ``A_n``, the accepted tokens, ``T_n``, the
self-conditioning input) that the exact per-step term of :class:`~dllm_trl.losses.DiffusionGemmaRLDFLoss` replays.
This module scores the final completion itself, the uniform-noise analogue of d1's one-step estimator:

* :func:`final_state_states`: per row, ``k`` states; each picks one of the row's canvases (uniformly among those
  holding its completion, up to the one with its first EOS), a noise level ``t ~ U(0, 1)``, and re-noises that final
  canvas as DiffusionGemma's own noise does (each position replaced, with probability ``t``, by a uniform token of
  the vocabulary; no mask token). Its temperature is the schedule's at the same fraction of steps remaining,
  ``T = t_min + (t_max − t_min) · t``.
* :func:`final_state_logps`: ``log softmax(logits / T)`` of the final token at every position of each state, the
  decoder reading the prompt and the row's earlier final canvases (one replay forward, as the rollout encoded them)
  and no self-conditioning signal (a canvas's first step);
* :func:`final_state_policy_loss`: ``−Σ A · log π`` over the completion's positions, divided by their count.

It is a surrogate, not the likelihood of the sampled trajectory: the states are not the ones the rollout visited,
the targets are the final tokens rather than the drawn ones, and there is no self-conditioning. On the Sudoku toys its
gradient is nearly orthogonal to the exact per-step one and closer to RLDF's (the clean targets), and it trains the
noisy teacher about two thirds as far as RLDF (``benchmarks/diffusion_gemma_final_state.py``; ``docs/vllm.md``,
"DiffusionGemma on vLLM"). It is not wired into any trainer.
"""

from __future__ import annotations

import torch

from ..generation.diffusion_gemma import replay_logits
from ..models.engines import unwrap_model


def final_state_states(completion_ids: torch.Tensor, completion_mask: torch.Tensor, canvas_length: int,
                       num_states: int, vocab_size: int, t_min: float, t_max: float,
                       generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``num_states`` re-noised copies per row of its final completion (module docstring).

    ``completion_ids`` / ``completion_mask`` (B, G): the rollout's completion and its mask up to the first EOS;
    ``G`` a multiple of ``canvas_length``. Draws, in this order, from ``generator``: the canvas picks (B, k), the
    noise levels (B, k), the noise decisions (B, k, L), the noise tokens (B, k, L).

    Returns ``state_canvas`` (B, k) canvas index, ``noise_level`` (B, k) ``t``, ``state_temperature`` (B, k),
    ``state_ids`` (B, k, L) the re-noised canvas, ``state_noised`` (B, k, L) which positions were re-drawn,
    ``target_ids`` (B, k, L) the final canvas and ``state_valid`` (B, k, L) its completion mask.
    """
    if completion_ids.shape != completion_mask.shape or completion_ids.dim() != 2:
        raise ValueError(f"completion_ids {tuple(completion_ids.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must both be (batch, completion length).")
    batch, width = completion_ids.shape
    if canvas_length < 1 or width % canvas_length:
        raise ValueError(f"the completion length {width} is not a whole number of canvases of canvas_length="
                         f"{canvas_length}: pass the rollout's completion_ids (gen_length is whole canvases).")
    if num_states < 1:
        raise ValueError(f"num_states={num_states} must be ≥ 1 (re-noised states per row).")
    if not 0 <= t_min <= t_max:
        raise ValueError(f"the temperatures must satisfy 0 ≤ t_min ≤ t_max (got {t_min}, {t_max}): pass the "
                         "sampler's t_min / t_max.")
    device = completion_ids.device
    shape = (batch, num_states)
    mask = completion_mask.bool()
    # Canvases holding the completion: up to the one with the first EOS (all of them without an EOS).
    decoded = ((mask.sum(-1) + canvas_length - 1) // canvas_length).clamp_min(1)
    picks = torch.rand(shape, device=device, generator=generator)
    canvas = (picks * decoded.unsqueeze(1)).long().clamp_max(decoded.unsqueeze(1) - 1)
    level = torch.rand(shape, device=device, generator=generator)
    noised = torch.rand(*shape, canvas_length, device=device, generator=generator) < level.unsqueeze(-1)
    noise = torch.randint(0, vocab_size, (*shape, canvas_length), device=device, generator=generator)
    columns = canvas.unsqueeze(-1) * canvas_length + torch.arange(canvas_length, device=device)
    target = completion_ids.gather(1, columns.flatten(1)).view(*shape, canvas_length)
    valid = mask.gather(1, columns.flatten(1)).view(*shape, canvas_length)
    return {
        "state_canvas": canvas,
        "noise_level": level,
        "state_temperature": t_min + (t_max - t_min) * level,
        "state_ids": torch.where(noised, noise, target),
        "state_noised": noised,
        "target_ids": target,
        "state_valid": valid,
    }


def final_state_logps(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                      states: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, k, L) ``log softmax(logits / T)`` of each state's final token at every position (0 outside
    ``state_valid``), with gradient when enabled: one forward of the wrapped ``model`` for all states (the encoder
    over the prompts and final canvases, each state decoded over the cache before its canvas, no self-conditioning).

    ``prompt_ids`` / ``prompt_mask`` (B, P): the rollout's left-padded prompts; ``completion_ids`` (B, G) its
    completion; ``states``: :func:`final_state_states`'s output for them.
    """
    canvas = states["state_canvas"]
    batch, num_states, length = states["state_ids"].shape
    config = unwrap_model(model).config
    if length != config.canvas_length:
        raise ValueError(f"the states hold canvases of {length} tokens, the model's canvas_length is "
                         f"{config.canvas_length}: build them with final_state_states(..., canvas_length="
                         f"{config.canvas_length}).")
    embedding = unwrap_model(model).model.decoder.embed_tokens.weight
    no_signal = embedding.new_zeros(1, 1, 1, 1).expand(batch, num_states, length, embedding.shape[1])
    logits = replay_logits(model, prompt_ids, prompt_mask, completion_ids, canvas, states["state_ids"], no_signal,
                           torch.zeros_like(canvas, dtype=torch.bool), "embedding")
    logits = logits.view(batch, num_states, length, -1).float() / states["state_temperature"][..., None, None]
    logps = logits.log_softmax(-1).gather(-1, states["target_ids"].unsqueeze(-1)).squeeze(-1)
    return torch.where(states["state_valid"], logps, 0.0)


def final_state_policy_loss(logps: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE on the final-state term: ``−Σ_b A_b Σ_{j,i} valid · log π`` over the (B, k, L) ``logps``, divided
    by the number of valid positions (token normalisation)."""
    weighted = advantages.view(-1, 1, 1).to(logps.dtype) * logps * valid
    return -weighted.sum() / valid.sum().clamp_min(1)
