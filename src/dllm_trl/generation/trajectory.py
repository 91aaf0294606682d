"""The per-step record of a denoising rollout in which a position can be accepted at many steps (uniform-noise
diffusion: DiffusionGemma), next to the masked-diffusion record of ``DiffusionGenerationOutput.commit_step``, where a
position is committed once."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DenoisingSteps:
    """Per lock-step step ``s`` of a uniform-noise rollout (``S`` steps over all canvases, canvas length ``L``): the
    record a loss needs to recompute the distribution each accepted token was drawn from. A position may be accepted
    at many steps (and re-noised in between), unlike a masked-diffusion ``commit_step``.

    ``canvas`` (S,): the canvas each step refines. ``temperature`` (S,) float32: ``T_n``. ``has_self_conditioning``
    (S,): False at a canvas's first step (zeros fed). ``state_ids`` (B, S, L): the canvas ``x_n`` the decoder read.
    ``accept_mask`` (B, S, L): ``A_n``. ``accepted_ids`` (B, S, L): ``y`` on ``A_n`` (``x_n`` elsewhere).
    ``accepted_logps`` (B, S, L) float32: ``log π_old(y_i | x_n, sc_n, T_n)`` on ``A_n`` (0 elsewhere). ``active``
    (B, S): the row was still denoising this canvas and had not finished its sequence. ``self_conditioning`` (B, S, L,
    H or V): the carrier's record (``carrier``: ``"embedding"`` or ``"logits"``). ``topk_ids`` int32 / ``topk_logps``
    (B, S, L, K): the top-K of each step's tempered distribution, when the sampler was asked to record them.
    """

    canvas: torch.Tensor
    temperature: torch.Tensor
    has_self_conditioning: torch.Tensor
    state_ids: torch.Tensor
    accept_mask: torch.Tensor
    accepted_ids: torch.Tensor
    accepted_logps: torch.Tensor
    active: torch.Tensor
    self_conditioning: torch.Tensor
    carrier: str
    topk_ids: torch.Tensor | None = None
    topk_logps: torch.Tensor | None = None
