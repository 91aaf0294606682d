"""Monte-Carlo ELBO of ``log p(continuation | context)`` under a masked diffusion LM (SPEC §11, "Likelihood for
lm-eval"): tensors in, tensors out, for lm-eval's likelihood requests and the sequence-level RL objectives alike.

With ``L`` continuation tokens ``x``, the masked-diffusion bound (LLaDA Eq. 3 / Dream's) is

    ELBO(x | c) = E_{l ~ U{1..L}} E_{M ⊂ [L], |M| = l} [ (L / l) Σ_{i ∈ M} log p(x_i | c, x with M masked) ]
                = E_{t ~ U(0,1)} E_{M ~ Bernoulli(t)^L} [ (1 / t) Σ_{i ∈ M} log p(x_i | …) ],

the two lines equal (each mask ``M`` of ``k`` tokens weighs ``(k−1)!(L−k)!/L!`` in both). Its estimators here:

* ``llada`` (LLaDA's ``eval_llada.py``): each row of a mask batch of ``n`` masks ``l`` tokens chosen uniformly,
  ``l = 1 + ⌊L (u + r) / n⌋`` for row ``r`` and one uniform offset ``u`` shared by the batch (stratified: every row's
  ``l`` is exactly uniform on ``{1..L}``, unlike the reference's ``round``, SPEC's first trap), weight ``L / l``.
* ``dream`` (Dream's eval): row ``r`` masks each token with probability ``t = (u + r) / n``; the weight is
  ``(L + 1) / k`` for the ``k`` tokens it masked, which is ``E[1/t | k]`` (the Beta posterior of ``t``): the literal
  ``1/t`` is unbiased too but has infinite variance (``E[1/t² ; k = 1] = ∫ L(1−t)^{L−1}/t dt``), which Dream's eval
  caps with a floor on ``t`` at the price of a bias. Rows with ``k = 0`` add 0. Dream's clean first and last row
  positions (SPEC's second trap) are not reproduced.
* ``left_to_right``: exact and deterministic, ``Σ_j log p(x_j | c, x_{<j}, the rest masked)`` (one state per token).

A single continuation token has an exact ELBO, ``log p(x_1 | c, M)``: one state, whatever the estimator.

Block-diffusion LMs (``config.diffusion_block_size``: SDAR, Fast-dLLM v2, LLaDA2) factor over their blocks,
``log p(x | c) = Σ_b log p(x_b | c, x_{<b})``; each block is scored with its earlier blocks clean and the later ones
absent (block-causal attention: they change nothing), and the estimator runs inside the block. Uniform-noise models
(DiffusionGemma) have no mask token and no masked ELBO: they are refused.

The prompt (context) is never masked. Every random draw comes from a CPU ``torch.Generator`` the caller seeds, so a
result is a function of the inputs and the seed only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ELBO_ESTIMATORS = ("llada", "dream", "left_to_right")
"""Values of ``estimator``."""

ScoreFn = Callable[[torch.Tensor], torch.Tensor]
"""``score(mask (n, L) bool) -> (n, L)``: ``log p(x_i | c, x with mask's positions masked)``, read at the masked
positions (:func:`segment_scorer` builds one from a model)."""


@dataclass(frozen=True)
class ElboEstimate:
    """An estimate of ``log p(continuation | context)`` in nats: ``value``, its Monte-Carlo standard error
    ``stderr`` (0 when exact; NaN from a single mask batch) and ``greedy``: whether every continuation token is the
    model's argmax in its left-to-right state (context and earlier tokens clean, later masked; ``None`` when not
    asked)."""

    value: float
    stderr: float
    greedy: bool | None = None


def check_estimator(estimator: str, mc_num: int, mc_batch_size: int) -> None:
    """Refuse unknown estimators and sample counts that do not split into whole mask batches."""
    if estimator not in ELBO_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: expected one of {ELBO_ESTIMATORS}.")
    for name, value in (("mc_num", mc_num), ("mc_batch_size", mc_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if mc_num % mc_batch_size:
        raise ValueError(f"mc_num={mc_num} is not a multiple of mc_batch_size={mc_batch_size}: every mask batch is "
                         "stratified over its rows, so pass an mc_num that is a whole number of batches.")


def _row_fractions(rows: int, generator: torch.Generator, stratified: bool) -> torch.Tensor:
    """(rows,) float64 in [0, 1): ``(u + r) / rows`` with one shared ``u`` (stratified), else independent uniforms."""
    if stratified:
        offset = torch.rand((), dtype=torch.float64, generator=generator)
        return (offset + torch.arange(rows, dtype=torch.float64)) / rows
    return torch.rand(rows, dtype=torch.float64, generator=generator)


def llada_masks(length: int, rows: int, generator: torch.Generator, stratified: bool = True):
    """``(mask (rows, L) bool, weight (rows,) float64)`` of LLaDA's estimator (module docstring)."""
    counts = (1 + (_row_fractions(rows, generator, stratified) * length).floor().long()).clamp(max=length)
    order = torch.rand(rows, length, dtype=torch.float64, generator=generator).argsort(dim=1).argsort(dim=1)
    return order < counts[:, None], length / counts.double()


def dream_masks(length: int, rows: int, generator: torch.Generator, stratified: bool = True):
    """``(mask (rows, L) bool, weight (rows,) float64)`` of Dream's estimator with the ``(L + 1) / k`` weight."""
    ratio = _row_fractions(rows, generator, stratified)
    mask = torch.rand(rows, length, dtype=torch.float64, generator=generator) < ratio[:, None]
    counts = mask.sum(1).double()
    return mask, torch.where(counts > 0, (length + 1) / counts.clamp(min=1), torch.zeros_like(counts))


def mc_elbo(score: ScoreFn, length: int, estimator: str, mc_num: int, mc_batch_size: int,
            generator: torch.Generator, stratified: bool = True) -> tuple[float, float]:
    """``(estimate, stderr)`` of the ELBO of ``length`` tokens by ``estimator`` (``llada`` / ``dream``) over
    ``mc_num`` masks in batches of ``mc_batch_size`` (one ``score`` call each); the standard error comes from the
    batch means (independent; the rows of one batch are not)."""
    check_estimator(estimator, mc_num, mc_batch_size)
    draw = {"llada": llada_masks, "dream": dream_masks}[estimator]
    batch_means = []
    for _ in range(mc_num // mc_batch_size):
        mask, weight = draw(length, mc_batch_size, generator, stratified)
        if mask.any():
            logps = score(mask).double().cpu()
            rows = (logps * mask).sum(1) * weight
        else:
            rows = torch.zeros(mc_batch_size, dtype=torch.float64)
        batch_means.append(rows.mean())
    means = torch.stack(batch_means)
    stderr = (means.std() / len(means) ** 0.5).item() if len(means) > 1 else float("nan")
    return means.mean().item(), stderr


def left_to_right_masks(length: int) -> torch.Tensor:
    """(L, L) bool: state ``j`` masks tokens ``j..L−1`` (its target is token ``j``)."""
    positions = torch.arange(length)
    return positions[None, :] >= positions[:, None]


# --------------------------------------------------------------------------------------------------- on a model


def _mask_token_id(model) -> int:
    from ..models.engines import model_config

    mask_token_id = getattr(model_config(model), "mask_token_id", None)
    if mask_token_id is None:
        raise ValueError(
            f"{type(model).__name__} has no mask token (config.mask_token_id): the masked-diffusion ELBO needs one. "
            "A uniform-noise diffusion LM such as DiffusionGemma corrupts tokens into random tokens, not into a mask, "
            "so its likelihood is not this bound (nor any the library estimates); score it by generation instead."
        )
    return int(mask_token_id)


def segment_scorer(model, context_ids: torch.Tensor, target_ids: torch.Tensor, prompt_length: int,
                   cfg_scale: float = 0.0):
    """``score(mask, read=None, with_argmax=False)``: the log-probabilities (n, L) of ``target_ids`` (L,) after
    ``context_ids`` (C,) with ``mask``'s positions replaced by the mask token, computed where ``read`` (default:
    ``mask``) is set and 0 elsewhere (and, ``with_argmax``, the model's argmax ids there too: ``(logps, argmax)``).
    With ``cfg_scale > 0`` classifier-free guidance as LLaDA's eval: ``ℓ_u + (s + 1)(ℓ_c − ℓ_u)`` with the
    unconditional logits ``ℓ_u`` of the same state behind a masked prompt (the first ``prompt_length`` context
    tokens; earlier blocks of a block model stay clean)."""
    from ..models.scoring import completion_logits, completion_token_logps

    mask_token_id = _mask_token_id(model)
    device = context_ids.device

    def score(mask: torch.Tensor, read: torch.Tensor | None = None, with_argmax: bool = False):
        mask = mask.to(device)
        read = mask if read is None else read.to(device)
        rows = mask.shape[0]
        states = torch.where(mask, torch.full_like(mask, mask_token_id, dtype=torch.long), target_ids[None])
        contexts = context_ids[None].expand(rows, -1)
        ones = torch.ones_like(contexts)
        targets = target_ids[None].expand(rows, -1)
        if cfg_scale == 0:
            argmax_view = (lambda hidden, head: head(hidden).argmax(-1)) if with_argmax else None
            return completion_token_logps(model, contexts, ones, states, targets, read_mask=read,
                                          extra_view=argmax_view)
        logits = completion_logits(model, contexts, ones, states).float()
        unconditional = contexts.clone()
        unconditional[:, :prompt_length] = mask_token_id
        plain = completion_logits(model, unconditional, ones, states).float()
        logits = plain + (cfg_scale + 1) * (logits - plain)
        logps = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * read
        return (logps, logits.argmax(-1) * read) if with_argmax else logps

    return score


def left_to_right_terms(score, length: int, batch_rows: int, with_argmax: bool = False):
    """``(logps (L,) float64, argmax (L,) or None)`` of the left-to-right states, ``batch_rows`` states a forward,
    each reading its own target only."""
    masks = left_to_right_masks(length)
    logps, argmax = [], []
    for start in range(0, length, batch_rows):
        rows = masks[start : start + batch_rows]
        read = torch.zeros_like(rows)
        read[torch.arange(rows.shape[0]), torch.arange(start, start + rows.shape[0])] = True
        out = score(rows, read, with_argmax)
        values, picks = out if with_argmax else (out, None)
        logps.append(values.double().cpu()[read.cpu()])
        if with_argmax:
            argmax.append(picks.cpu()[read.cpu()])
    return torch.cat(logps), torch.cat(argmax) if with_argmax else None


def block_segments(model, prompt_length: int, length: int) -> list[tuple[int, int]]:
    """``(start, stop)`` continuation slices scored as one unit: the whole continuation on a bidirectional model, one
    attention block each on a block-diffusion model (the continuation starts on a block boundary: the prompt is
    left-padded to one, as the sampler's canvas)."""
    from ..models.bidirectional import diffusion_block_size

    block = diffusion_block_size(model)
    if not block:
        return [(0, length)]
    return [(start, min(start + block, length)) for start in range(0, length, block)]


@torch.no_grad()
def sequence_elbo(model, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor, estimator: str = "llada",
                  mc_num: int = 128, mc_batch_size: int = 32, generator: torch.Generator | None = None,
                  cfg_scale: float = 0.0, stratified: bool = True, with_greedy: bool = False) -> ElboEstimate:
    """The ELBO estimate of ``log p(continuation_ids | prompt_ids)`` (1-D id tensors on the model's device) under
    ``model`` (module docstring): ``mc_num`` masks per unit (the continuation, or each block of a block-diffusion
    model) in batches of ``mc_batch_size``, drawn from ``generator`` (CPU; a fresh one seeded 0 when None); a
    one-token unit is scored exactly with one state. ``with_greedy`` also answers :attr:`ElboEstimate.greedy`."""
    check_estimator(estimator, mc_num, mc_batch_size)
    if continuation_ids.dim() != 1 or prompt_ids.dim() != 1 or continuation_ids.numel() == 0:
        raise ValueError("prompt_ids and continuation_ids must be 1-D id tensors, the continuation non-empty.")
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    total, variance, greedy = 0.0, 0.0, True
    for start, stop in block_segments(model, prompt_ids.numel(), continuation_ids.numel()):
        context = torch.cat([prompt_ids, continuation_ids[:start]])
        target = continuation_ids[start:stop]
        length = stop - start
        score = segment_scorer(model, context, target, prompt_ids.numel(), cfg_scale)
        exact = estimator == "left_to_right" or length == 1
        if exact or with_greedy:
            logps, argmax = left_to_right_terms(score, length, mc_batch_size, with_greedy)
            if with_greedy:
                greedy &= bool((argmax == target.cpu()).all())
            if exact:
                total += logps.sum().item()
                continue
        value, stderr = mc_elbo(score, length, estimator, mc_num, mc_batch_size, generator, stratified)
        total += value
        variance += stderr**2
    return ElboEstimate(total, variance**0.5, greedy if with_greedy else None)
