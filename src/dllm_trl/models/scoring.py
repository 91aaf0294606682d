"""Per-token log-probabilities of a diffusion LM at a given canvas (the training forward of SPEC §2.2)."""

from __future__ import annotations

import torch

from .bidirectional import diffusion_config


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[index]`` in float32, without keeping a full-vocabulary log-softmax around."""
    logits = logits.float()
    picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def completion_logits(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, state_ids: torch.Tensor
) -> torch.Tensor:
    """Logits (B, G, V) of ``π(· | q, state)`` at every completion position (one full forward, no cache).

    The LM head runs only on the positions that predict the completion (one earlier for shifted models).
    """
    config = diffusion_config(model)
    shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
    prompt_len, gen = prompt_ids.shape[1], state_ids.shape[1]
    if prompt_len < shift:
        raise ValueError("A model with a logit shift needs a prompt of at least one token.")
    input_ids = torch.cat([prompt_ids, state_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(state_ids)], dim=1)
    positions = torch.arange(prompt_len - shift, prompt_len + gen - shift, device=input_ids.device)
    return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions, use_cache=False).logits


def completion_token_logps(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, state_ids: torch.Tensor, target_ids: torch.Tensor
) -> torch.Tensor:
    """``log π(target_i | q, state)`` (B, G) in float32."""
    return selective_log_softmax(completion_logits(model, prompt_ids, prompt_mask, state_ids), target_ids)
