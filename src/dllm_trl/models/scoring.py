"""Per-token log-probabilities of a diffusion LM at a given canvas (the training forward of SPEC §2.2)."""

from __future__ import annotations

import torch

from .bidirectional import diffusion_block_size, diffusion_config
from .block_attention import align_prompt
from .engines import apply_at, logits_at


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, in float32."""
    logits = logits.float()
    log_probs = logits.log_softmax(-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[index]`` in float32, without keeping a full-vocabulary log-softmax around."""
    logits = logits.float()
    picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def state_canvas(config, prompt_ids, prompt_mask, state_ids, shift):
    """``(input_ids, attention_mask, prompt_width)`` of ``q ⊕ state`` (every state position is a real key); for a
    block-diffusion LM (``config.diffusion_block_size``) the prompt is left-padded to a block boundary, as the
    sampler's canvas, and ``prompt_width`` counts that padding."""
    if prompt_ids.shape[1] < shift:
        raise ValueError("A model with a logit shift needs a prompt of at least one token.")
    prompt_ids, prompt_mask = align_prompt(prompt_ids, prompt_mask, diffusion_block_size(config), config.mask_token_id)
    input_ids = torch.cat([prompt_ids, state_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(state_ids)], dim=1)
    return input_ids, attention_mask, prompt_ids.shape[1]


def completion_logits(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, state_ids: torch.Tensor
) -> torch.Tensor:
    """Logits (B, G, V) of ``π(· | q, state)`` at every completion position (one full forward, no cache).

    The LM head runs only on the positions that predict the completion (one earlier for shifted models).
    """
    config = diffusion_config(model)
    shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
    input_ids, attention_mask, prompt_len = state_canvas(config, prompt_ids, prompt_mask, state_ids, shift)
    gen = state_ids.shape[1]
    positions = torch.arange(prompt_len - shift, prompt_len + gen - shift, device=input_ids.device)
    return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions, use_cache=False).logits


def completion_token_logps(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    state_ids: torch.Tensor,
    target_ids: torch.Tensor,
    read_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    extra_view=None,
):
    """``log π(target_i | q, state)`` (B, G) in float32 (and, ``with_entropy``, the entropy of ``π(· | q, state)``
    at each read position, (B, G); with gradient when grad is enabled, unless ``entropy_grad`` is False: a metric).

    With ``read_mask`` (B, G) the LM head and the log-softmax run only where it is set (0 is returned elsewhere):
    the loss reads a few positions of each state, and the full-vocabulary logits of the others are never built.
    ``extra_view`` (needs ``read_mask``): see :func:`chunked_token_logps_at`; its values come last, scattered (B, G).
    """
    if read_mask is None:
        if extra_view is not None:
            raise ValueError("extra_view reads the positions of read_mask: pass one.")
        logits = completion_logits(model, prompt_ids, prompt_mask, state_ids)
        logps = selective_log_softmax(logits, target_ids)
        return (logps, token_entropy(logits)) if with_entropy else logps
    config = diffusion_config(model)
    shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
    input_ids, attention_mask, prompt_len = state_canvas(config, prompt_ids, prompt_mask, state_ids, shift)
    rows, columns = read_mask.nonzero(as_tuple=True)
    values = chunked_token_logps_at(
        model, rows, columns + (prompt_len - shift), target_ids[rows, columns], with_entropy=with_entropy,
        entropy_grad=entropy_grad, extra_view=extra_view, input_ids=input_ids, attention_mask=attention_mask,
    )
    scatter = lambda v: torch.zeros(read_mask.shape, dtype=v.dtype, device=v.device).index_put((rows, columns), v)  # noqa: E731
    return tuple(scatter(v) for v in values) if isinstance(values, tuple) else scatter(values)


def token_logps_at(
    model, rows: torch.Tensor, columns: torch.Tensor, target_ids: torch.Tensor, with_entropy: bool = False,
    **forward_kwargs,
):
    """``log π(target_ids[n])`` (N,) in float32 from the outputs at input positions ``(rows[n], columns[n])`` of one
    forward of ``model(**forward_kwargs)`` (no cache; the LM head runs at those positions only), and with
    ``with_entropy`` the entropy there too. The packed forward of block-diffusion states
    (:mod:`dllm_trl.losses.packed_states`) passes its ids, position ids and 4-D mask."""
    logits, _ = logits_at(model, rows, columns, use_cache=False, **forward_kwargs)
    logps = selective_log_softmax(logits, target_ids)
    return (logps, token_entropy(logits)) if with_entropy else logps


def chunked_token_logps_at(
    model, rows: torch.Tensor, columns: torch.Tensor, target_ids: torch.Tensor, with_entropy: bool = False,
    entropy_grad: bool = True, chunk_elements: int = 2**23, extra_view=None, **forward_kwargs,
):
    """:func:`token_logps_at` with the LM head applied in chunks of positions (about ``chunk_elements`` logits each:
    32 MiB in float32, 66 positions at V = 126 464), each chunk recomputed in the backward pass instead of kept
    (activation checkpointing).

    Memory of the head and the log-softmax is one chunk's ``(n, V)``, whatever the number of positions read: the
    equivalent of TRL's chunked LM head for the loss and scoring passes, where RLDF reads every candidate of a state
    (on-policy, every still-masked token, to fix the clean targets from the same forward).

    ``extra_view(hidden (N, d), head) -> (N,)``: one more value per position read from the same forward (e.g. the
    sampler's log-probability at a few of them), returned last: ``(logps[, entropies], extra)``.
    """

    def view(hidden, head):
        values = chunked_head_logps(hidden, head, target_ids, with_entropy, chunk_elements, entropy_grad)
        if extra_view is None:
            return values
        return (*(values if with_entropy else (values,)), extra_view(hidden, head))

    return apply_at(model, rows, columns, view, use_cache=False, **forward_kwargs)


def chunked_head_logps(hidden, head, target_ids, with_entropy=False, chunk_elements=2**23, entropy_grad=True):
    """``log softmax(head(hidden))[target_ids]`` (N,) in float32 (and the entropies, with ``with_entropy``) from
    hidden states ``(N, d)``, chunk by chunk, checkpointed when the hidden states carry gradient. With
    ``entropy_grad=False`` the entropies are computed without a graph (a metric: less memory in the backward)."""

    def chunk(h, targets):
        logits = head(h).float()
        lse = torch.logsumexp(logits, dim=-1)
        logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if not with_entropy:
            return (logps,)
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            log_probs = logits - lse.unsqueeze(-1)
            return logps, -(log_probs.exp() * log_probs).sum(-1)

    values = head_in_chunks(chunk, head, chunk_elements, hidden, target_ids)
    return tuple(values) if with_entropy else values[0]


def head_in_chunks(chunk, head, chunk_elements: int, hidden: torch.Tensor, *per_position: torch.Tensor) -> list:
    """``chunk(hidden[i:j], *[t[i:j] for t in per_position])`` over row chunks of about ``chunk_elements`` logits of
    ``head`` each, checkpointed when ``hidden`` carries gradient (each chunk's full-vocabulary work is recomputed in
    the backward instead of kept); returns each output concatenated over the chunks (``None`` stays ``None``).
    With no rows, one empty call still hangs the outputs off the graph (DDP needs one)."""
    vocab = getattr(head, "out_features", None) or 2**17
    step = max(1, chunk_elements // vocab)
    checkpointed = torch.is_grad_enabled() and hidden.requires_grad
    pieces = []
    for start in range(0, hidden.shape[0], step):
        part = [t[start : start + step] for t in (hidden, *per_position)]
        pieces.append(torch.utils.checkpoint.checkpoint(chunk, *part, use_reentrant=False) if checkpointed
                      else chunk(*part))
    if not pieces:
        pieces.append(chunk(*(t[:0] for t in (hidden, *per_position))))
    return [None if column[0] is None else torch.cat(column) for column in zip(*pieces)]
