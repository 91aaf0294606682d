"""Block-wise masked-diffusion decoding with a KV cache that records the denoising trajectory (SPEC §1.1–1.3, §7).

The loop: for each block, repeat {read the block's still-masked positions, draw a candidate and its confidence per
position, commit some of them} until the block is decoded. Rows of a batch advance in lock-step; a row whose block
is done simply commits nothing. One loop serves both kinds of model; only the model calls differ:

* bidirectional models (:class:`_CanvasCalls`): a block's first step runs the whole canvas and refreshes the
  Fast-dLLM-style cache (``cache.py``: every canvas position's keys and values in canvas order; a cached step
  writes only its window's, in place);
* block-diffusion models (:class:`_BlockCalls`, ``config.diffusion_block_size``): steps feed only the current
  attention block, over the exact cache of the finished blocks, each written once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..models.bidirectional import (
    attention_mask_4d,
    attention_mask_dtype,
    diffusion_block_size,
    diffusion_config,
    eos_token_ids,
)
from ..models.block_attention import align_prompt, block_causal_mask, column_blocks
from ..models.engines import LockStep, logits_at, unwrap_model
from ..models.routing import RoutingCapture
from .cache import BlockCache, CanvasCache, cache_keyword
from .config import DiffusionGenerationConfig
from .trajectory import DenoisingSteps

NEVER_COMMITTED = 2**31 - 1
"""``commit_step`` of positions the sampler never decoded (filled with EOS after an early stop)."""


@dataclass
class DiffusionGenerationOutput:
    """What one rollout produced.

    ``sequences`` (B, P+G): prompt ⊕ decoded completion region. ``completion_ids`` (B, G): the decoded
    region. ``completion_mask`` (B, G): 1 up to and including the first EOS. ``commit_step`` (B, G): the
    row's decoding step at which each position was committed (dense per row, from 0; ``NEVER_COMMITTED``
    for positions filled after an early stop). ``commit_prob`` (B, G): the committed token's probability
    under the distribution it was drawn from. ``topk_ids`` / ``topk_logps`` (B, G, K): that distribution's
    top-K (when ``record_topk > 0``). ``nfe``: model forward passes. ``num_steps`` (B,): steps per row.
    ``routed_experts`` (B, G, MoE layers, k) int16 (when ``record_routing``): the experts each position was routed to
    at each MoE layer in the forward of the step that committed it (−1 where nothing was committed).
    ``denoising_steps``: the per-step record of a rollout that accepts a position at many steps (uniform-noise
    diffusion, :class:`~dllm_trl.generation.trajectory.DenoisingSteps`); None for masked diffusion, where
    ``commit_step`` is the whole story.
    """

    sequences: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    commit_step: torch.Tensor
    commit_prob: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_logps: torch.Tensor | None
    nfe: int
    num_steps: torch.Tensor
    routed_experts: torch.Tensor | None = None
    denoising_steps: DenoisingSteps | None = None


def completion_mask_to_eos(completion: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """(B, G) long: 1 up to and including each row's first EOS (every position when it has none)."""
    is_eos = torch.isin(completion, eos)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    return (torch.arange(completion.shape[1], device=completion.device)[None, :] <= first_eos[:, None]).long()


def static_schedule(block_length: int, steps_per_block: int) -> list[int]:
    """Tokens committed at each step of a block: even split, remainder to the first steps."""
    base, extra = divmod(block_length, steps_per_block)
    return [base + (1 if i < extra else 0) for i in range(steps_per_block)]


@functools.lru_cache(maxsize=64)
def _warpers(top_k: int | None, top_p: float | None, min_p: float | None) -> tuple:
    """transformers' own sampling warpers for these settings, in the order ``GenerationMixin._get_logits_processor``
    applies them: top-k, then top-p, then min-p (temperature comes before all three, in the caller).

    ``min_tokens_to_keep`` is transformers' default for plain sampling (1). Settings that cannot drop a token are
    left out, as transformers leaves them out (top_k None / 0, top_p None / 1) or as they change nothing (min_p 0:
    no probability is below 0). The warpers hold only their settings, so one tuple serves every step.
    """
    warpers = []
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=int(top_k)))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p=min_p))
    return tuple(warpers)


def _truncate_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None, min_p: float | None = None):
    """``logits`` (..., V) with the tokens transformers' top-k → top-p → min-p sampling drops set to -inf."""
    warpers = _warpers(top_k, top_p, min_p)
    if not warpers:
        return logits
    scores = logits.reshape(-1, logits.shape[-1])  # the warpers read (batch, vocab) scores and no input ids
    for warper in warpers:
        scores = warper(None, scores)
    return scores.view(logits.shape)


def draw_candidates(
    logits: torch.Tensor,
    mask_token_id: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    sampling: str,
    generator: torch.Generator | None,
    min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one candidate per position from ``logits`` (..., V).

    Returns ``(candidate, confidence, log_probs)``: the confidence is the candidate's probability under the
    distribution it was drawn from (after temperature and truncation; plain softmax at temperature 0) and
    ``log_probs`` that distribution, in float32. The mask token is never a candidate. ``logits`` is not
    modified.
    """
    return _draw_candidates(
        logits.to(torch.float32, copy=True), mask_token_id, temperature, top_p, top_k, sampling, generator,
        min_p=min_p,
    )


def _draw_candidates(logits, mask_token_id, temperature, top_p, top_k, sampling, generator, with_log_probs=True,
                     min_p=None):
    """:func:`draw_candidates` on float32 ``logits`` that it may overwrite (the sampler's own, saving a copy).

    Greedy without ``with_log_probs`` returns ``log_probs=None`` and works in place: at a 126k vocabulary a fresh
    (n, V) tensor per step costs about as much as the rest of the draw.
    """
    logits[..., mask_token_id] = float("-inf")
    if temperature == 0 and not with_log_probs:
        top, candidate = logits.max(-1)
        confidence = logits.sub_(top.unsqueeze(-1)).exp_().sum(-1).reciprocal()  # softmax at the argmax
        return candidate, confidence, None
    log_probs = _sampling_log_probs(logits, mask_token_id, temperature, top_p, top_k, min_p)
    if temperature == 0:
        candidate = log_probs.argmax(-1)
    elif sampling == "gumbel":
        # Gumbel-max in float64: argmax(logits/T + G) is a draw from softmax(logits/T).
        uniform = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
        candidate = (log_probs.double() + gumbel).argmax(-1)
    else:
        flat = log_probs.reshape(-1, log_probs.shape[-1]).exp()
        candidate = torch.multinomial(flat, 1, generator=generator).view(log_probs.shape[:-1])
    confidence = log_probs.gather(-1, candidate.unsqueeze(-1)).squeeze(-1).exp()
    return candidate, confidence, log_probs


def sampling_log_probs(logits: torch.Tensor, mask_token_id: int, temperature: float, top_p: float | None = None,
                       top_k: int | None = None, min_p: float | None = None) -> torch.Tensor:
    """Log-probabilities (..., V), float32, of the distribution the sampler draws a candidate from at ``logits``:
    the mask token excluded, then temperature and top-k / top-p / min-p truncation (plain softmax at temperature 0).
    What ``commit_prob`` records for the committed token; ``logits`` is not modified."""
    return _sampling_log_probs(logits.to(torch.float32, copy=True), mask_token_id, temperature, top_p, top_k, min_p)


def _sampling_log_probs(logits, mask_token_id, temperature, top_p, top_k, min_p):
    """:func:`sampling_log_probs` on float32 ``logits`` that it may overwrite."""
    logits[..., mask_token_id] = float("-inf")
    if temperature > 0:
        logits = _truncate_logits(logits.div_(temperature), top_k, top_p, min_p)
    return torch.log_softmax(logits, dim=-1)


def _block_window(cache_mode: str, start: int, end: int, total: int, shift: int) -> slice | None:
    """The canvas positions a cached step of block [start, end) feeds under ``cache_mode`` (None without a cache).

    A shifted model predicts position j from j - 1, so the window starts one position early. Prefix cache feeds
    the block and everything after it; dual cache feeds only the block.
    """
    if cache_mode == "none":
        return None
    return slice(start - shift, end if cache_mode == "dual" else total)


def _logits_at(model, ids, positions, mask, cache, rows, columns):
    """The sampler's one model call: float logits ``(n, V)`` at the fed positions ``(rows, columns)``.

    ``ids`` and ``positions`` (B, q): the fed canvas positions and their position ids; ``mask`` (B, 1, q, P+G):
    the keys each query attends to; ``cache``: the :class:`CanvasCache` or :class:`BlockCache` the call reads and
    writes in place (None without a cache). The (possibly engine-wrapped) model's own forward runs, and only the read positions go through
    the LM head (:func:`~dllm_trl.models.engines.logits_at`); the logits are a fresh tensor the caller may overwrite.
    """
    logits, _ = logits_at(
        model, rows, columns, input_ids=ids, attention_mask=mask, position_ids=positions,
        use_cache=cache is not None, **{cache_keyword(unwrap_model(model)): cache},
    )
    return logits.float(), cache


class _CanvasCalls:
    """Model calls of a bidirectional model: a block's first step runs the whole canvas (refreshing the cache), its
    later steps only the cache mode's window (SPEC §1.2)."""

    def __init__(self, model, key_mask, cache_mode, shift, mask_dtype, num_layers):
        batch, total = key_mask.shape
        self.model, self.cache_mode, self.shift, self.total = model, cache_mode, shift, total
        # Keys stay in canvas order in every call, cached or not, so one key mask and one row of position ids serve
        # the whole rollout: a call feeding canvas positions ``fed`` takes their rows of both (views, no copies).
        self.key_mask_4d = attention_mask_4d(key_mask, batch, 1, total, key_mask.device, mask_dtype).expand(
            batch, 1, total, total
        )
        self.positions = torch.arange(total, device=key_mask.device).expand(batch, total)
        self.cache = None if cache_mode == "none" else CanvasCache(num_layers, total)

    def start_block(self, start: int, end: int) -> None:
        self.window = _block_window(self.cache_mode, start, end, self.total, self.shift)
        if self.cache is not None:
            self.cache.window_start = self.window.start
        self.fed = slice(0, self.total)  # a block's first step runs the whole canvas (and so refreshes the cache)

    def __call__(self, canvas, rows, columns):
        """Float logits ``(n, V)`` predicting the read positions: the outputs at canvas columns ``columns``."""
        fed = self.last_fed = self.fed
        logits, self.cache = _logits_at(
            self.model, canvas[:, fed], self.positions[:, fed], self.key_mask_4d[:, :, fed], self.cache,
            rows, columns - fed.start,
        )
        if self.window is not None:  # the block's later steps feed only the cache mode's window
            self.fed = self.window
        return logits


class _BlockCalls:
    """Model calls of a block-diffusion model (SPEC §7), whose attention blocks are ``block_size`` canvas columns
    (the prompt is left-padded to a block boundary, so the completion's blocks start at its first position).

    Without a cache every step runs the whole canvas under the block-causal mask. With one (``prefix`` and ``dual``
    are the same here: nothing after the current block is visible), the first step of an attention block feeds the
    previous one (or the prompt) and itself: the previous block's keys/values go into the :class:`BlockCache` — the
    only time they are written, as they never change again — and the step's logits come from the same forward. Its
    later steps feed only the block. A shifted model predicts the block's first position from the last output of
    the previous block, which the block cannot change: read in the first step, it is reused by the later ones.
    """

    def __init__(self, model, key_mask, cache_mode, shift, mask_dtype, num_layers, block_size):
        batch, total = key_mask.shape
        device = key_mask.device
        self.model, self.shift, self.block_size, self.mask_dtype, self.total = model, shift, block_size, mask_dtype, total
        self.key_mask = key_mask
        self.blocks = column_blocks(0, total, block_size, device)
        self.positions = torch.arange(total, device=device).expand(batch, total)
        self.cache = None if cache_mode == "none" else BlockCache(num_layers, total)
        self.full_mask = self._mask(0, total) if self.cache is None else None
        self.attention_block, self.cached_until, self.first_step, self.carry = None, 0, False, None

    def _mask(self, start: int, end: int) -> torch.Tensor:
        """The queries fed at canvas columns ``[start, end)`` over the keys ``[0, end)``."""
        queries = torch.arange(start, end, device=self.key_mask.device)
        return block_causal_mask(
            self.key_mask[:, :end], self.blocks[:end], self.blocks[start:end], queries, additive_dtype=self.mask_dtype
        )

    def start_block(self, start: int, end: int) -> None:
        if self.cache is None:
            self.fed, self.mask = slice(0, self.total), self.full_mask
            return
        first = start - start % self.block_size
        if first == self.attention_block:  # the next decoding block inside the same attention block
            return
        last = first + self.block_size
        self.fed, self.mask = slice(self.cached_until, last), self._mask(self.cached_until, last)
        self.later_fed, self.later_mask = slice(first, last), self._mask(first, last)
        self.attention_block, self.cached_until, self.first_step = first, first, True

    def __call__(self, canvas, rows, columns):
        """Float logits ``(n, V)`` predicting the read positions: the outputs at canvas columns ``columns``."""
        fed, mask = self.fed, self.mask
        self.last_fed = fed
        if self.cache is not None:
            self.cache.window_start = fed.start
        carry = self.shift and self.cache is not None
        if carry and self.first_step:
            # Also read the block's first position for every row (all of them are masked now): the carry.
            batch = canvas.shape[0]
            every_row = torch.arange(batch, device=rows.device)
            read_rows = torch.cat([rows, every_row])
            read_columns = torch.cat([columns, torch.full_like(every_row, self.attention_block - 1)])
        elif carry:
            # The block's first position is read at the previous block's last column, outside the fed block.
            read_rows, read_columns = rows, columns.clamp_min(fed.start)
        else:
            read_rows, read_columns = rows, columns
        logits, self.cache = _logits_at(
            self.model, canvas[:, fed], self.positions[:, fed], mask, self.cache, read_rows, read_columns - fed.start
        )
        if carry and self.first_step:
            self.carry = logits[rows.numel():].clone()
            logits = logits[: rows.numel()]
        elif carry:
            logits = torch.where((columns < fed.start).unsqueeze(-1), self.carry[rows], logits)
        if self.cache is not None:
            self.fed, self.mask, self.first_step = self.later_fed, self.later_mask, False
        return logits


def check_block_decoding(cfg: DiffusionGenerationConfig, block_size: int | None) -> None:
    """Refuse settings a block-diffusion model (attention blocks of ``block_size``; ``None``: bidirectional) cannot
    decode with."""
    if cfg.reference_decoder is not None and (block_size is None or cfg.block_length != block_size):
        raise ValueError(
            f"reference_decoder={cfg.reference_decoder!r} decodes a block-diffusion model's attention blocks whole: "
            f"use it on a block-diffusion model with block_length = config.diffusion_block_size ({block_size})."
        )
    if block_size is None:
        return
    if cfg.gen_length % block_size != 0:
        raise ValueError(
            f"gen_length={cfg.gen_length} is not a multiple of the model's attention block size ({block_size}, "
            "config.diffusion_block_size): a block-diffusion model decodes whole blocks; use a multiple of it."
        )
    if block_size % cfg.block_length != 0:
        raise ValueError(
            f"block_length={cfg.block_length} does not divide the model's attention block size ({block_size}, "
            "config.diffusion_block_size): a block-diffusion model decodes its blocks one after another, so the "
            f"decoding block must be the attention block or a sub-block of it; set block_length={block_size} (or a "
            "divisor of it)."
        )


def _dense_step_ranks(commit_step: torch.Tensor, total_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Relabel each row's lock-step indices as 0, 1, 2 … over the steps at which that row committed."""
    committed = commit_step != NEVER_COMMITTED
    used = torch.zeros(commit_step.shape[0], total_steps + 1, dtype=torch.long, device=commit_step.device)
    used.scatter_(1, torch.where(committed, commit_step, total_steps), 1)
    used[:, total_steps] = 0
    rank = used.cumsum(1) - 1
    dense = rank.gather(1, torch.where(committed, commit_step, 0))
    return torch.where(committed, dense, commit_step), used.sum(1)


@torch.no_grad()
def diffusion_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    generation_config: DiffusionGenerationConfig | None = None,
    generator: torch.Generator | None = None,
    step_callback: Callable[[int, torch.Tensor], None] | None = None,
) -> DiffusionGenerationOutput:
    """Decode ``gen_length`` tokens after left-padded prompts and record the denoising trajectory.

    ``step_callback(step, canvas)``, if given, sees the canvas (B, P+G) before every lock-step step.
    ``record_routing``: the routers of an MoE model are hooked for this call only (:class:`RoutingCapture`).

    ``model`` may be wrapped by an engine (DDP, DeepSpeed, FSDP2, PEFT): its own forward runs, with the LM head
    applied only at the positions a step reads (:func:`~dllm_trl.models.engines.logits_at`). A block-diffusion model
    (``config.diffusion_block_size``) decodes its attention blocks one after another (``block_length`` is the block
    or a sub-block of it) over the exact cache of the finished ones.

    Under engines whose forwards are collectives (FSDP, ZeRO-3 without gathered weights) a process whose rows are
    decoded sooner (a sure block commits in one step, an unsure one in ``block_length``) then runs idle forwards
    until every process is done (:class:`~dllm_trl.models.engines.LockStep`, SPEC §9): its own step's model call
    (the same cache mode's call on its finished canvas) reading no position, so the modules are reached as a
    decoding step reaches them; its rollout is unchanged.
    """
    cfg = generation_config or DiffusionGenerationConfig()
    lock = LockStep(model)
    partner = {}  # the decoding's own model call, reading nothing: the idle partner of another process's step

    def idle():
        (partner.get("step") or (lambda: idle_forward(model, input_ids)))()

    with lock.matched_forwards(model, idle):
        if not cfg.record_routing:
            return _decode(model, input_ids, attention_mask, cfg, generator, step_callback, None, partner)
        with RoutingCapture(model) as routing:
            return _decode(model, input_ids, attention_mask, cfg, generator, step_callback, routing, partner)


def idle_forward(model, input_ids: torch.Tensor) -> None:
    """A forward of ``model`` on one token, reading no logits: the partner of another process's step when this
    process has made no step of its own (its decoding stopped before the first model call)."""
    ids = input_ids[:1, :1]
    mask = torch.zeros(1, 1, 1, 1, dtype=attention_mask_dtype(model), device=ids.device)
    empty = torch.zeros(0, dtype=torch.long, device=ids.device)
    logits_at(model, empty, empty, input_ids=ids, attention_mask=mask,
              position_ids=torch.zeros_like(ids), use_cache=False)


def _decode(model, input_ids, attention_mask, cfg, generator, step_callback, routing, partner):
    """:func:`diffusion_generate`'s decoding, recording each step's routing when ``routing`` is a capture;
    ``partner["step"]``: its model call on the canvas, reading nothing (the lock-step idle partner)."""
    config = diffusion_config(model)
    mask_id = config.mask_token_id
    shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
    sampling = cfg.sampling or getattr(config, "diffusion_sampling", "gumbel")
    attention_block = diffusion_block_size(config)
    check_block_decoding(cfg, attention_block)
    eos_ids = eos_token_ids(config)
    if not eos_ids:
        raise ValueError("The model config has no eos_token_id; the sampler needs one to end completions.")
    device = input_ids.device
    batch, given_prompt_len = input_ids.shape
    if given_prompt_len < shift:
        raise ValueError("A model with a logit shift needs a prompt of at least one token.")
    gen, block = cfg.gen_length, cfg.block_length
    if generator is None and cfg.seed is not None:
        generator = torch.Generator(device=device).manual_seed(cfg.seed)

    prompt_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    reference = cfg.reference_decoder is not None
    if reference and shift:
        raise ValueError(f"reference_decoder={cfg.reference_decoder!r} is LLaDA2's decoder, for a model without a logit "
                         "shift (config.diffusion_logit_shift is True here).")
    if reference:
        # Blocks count from each row's first prompt token: rows may differ by whole blocks of left padding only.
        if ((given_prompt_len - prompt_mask.sum(1)) % attention_block).any():
            raise ValueError(
                f"reference_decoder={cfg.reference_decoder!r} counts blocks from each prompt's first token, so the "
                f"prompt lengths of a batch must agree modulo the block ({attention_block}); decode such rows apart."
            )
    else:
        # A block model's completion starts on an attention-block boundary: left padding (hidden by the key mask).
        input_ids, prompt_mask = align_prompt(input_ids, prompt_mask, attention_block, mask_id)
    pad = input_ids.shape[1] - given_prompt_len
    prompt_len = input_ids.shape[1]
    # The reference decoder decodes its last attention block whole; positions past gen_length are then dropped.
    decoded = -(-(prompt_len + gen) // attention_block) * attention_block - prompt_len if reference else gen
    total = prompt_len + decoded
    first_cut = (prompt_len // block + 1) * block if reference else prompt_len + block
    cuts = [prompt_len, *range(first_cut, total, block), total]
    cfg.check_positions(prompt_len, getattr(config, "max_position_embeddings", None))
    key_mask = torch.cat([prompt_mask, torch.ones(batch, decoded, dtype=torch.bool, device=device)], dim=1)
    canvas = torch.cat([input_ids, torch.full((batch, decoded), mask_id, dtype=input_ids.dtype, device=device)], dim=1)
    commit_step = torch.full((batch, decoded), NEVER_COMMITTED, dtype=torch.long, device=device)
    commit_prob = torch.zeros(batch, decoded, dtype=torch.float32, device=device)
    topk = cfg.record_topk
    topk_ids = torch.zeros(batch, decoded, topk, dtype=torch.long, device=device) if topk else None
    topk_logps = torch.full((batch, decoded, topk), float("-inf"), device=device) if topk else None
    routed = None  # (B, decoded, MoE layers, k), allocated at the first recorded step
    mask_dtype = attention_mask_dtype(model)
    if attention_block is None:
        calls = _CanvasCalls(model, key_mask, cfg.cache, shift, mask_dtype, config.num_hidden_layers)
    else:
        calls = _BlockCalls(model, key_mask, cfg.cache, shift, mask_dtype, config.num_hidden_layers, attention_block)
    nothing = torch.zeros(0, dtype=torch.long, device=device)
    canvas_in_use = canvas  # the full canvas (``canvas`` is cut to the completion at the end)
    eos_tensor = torch.tensor(eos_ids, device=device)
    steps_per_block = cfg.total_steps // cfg.num_blocks
    schedule = static_schedule(block, steps_per_block) if cfg.unmasking == "static" else None
    step, nfe = 0, 0

    for block_index, (start, end) in enumerate(zip(cuts[:-1], cuts[1:])):
        width = end - start  # the block, or the reference decoder's part of one after the prompt
        calls.start_block(start, end)
        partner["step"] = lambda: calls(canvas_in_use, nothing, nothing)
        step_in_block = 0
        while True:
            block_masked = canvas[:, start:end] == mask_id
            rows, columns = block_masked.nonzero(as_tuple=True)  # one host sync per step
            if rows.numel() == 0 or (schedule is not None and step_in_block == len(schedule)):
                break
            if step_in_block == width:  # every step commits ≥ 1 token, so this would loop forever
                raise RuntimeError(f"block {block_index} still has masks after {block} steps: no token was committed.")
            if step_callback is not None:
                step_callback(step, canvas[:, pad:])
            # The LM head and the softmax over the vocabulary dominate small shapes: read only each row's
            # still-masked block positions. A shifted model predicts position j from the output at j - 1.
            logits = calls(canvas, rows, start - shift + columns)
            nfe += 1
            candidate, confidence, log_probs = _draw_candidates(
                logits, mask_id, cfg.temperature, cfg.top_p, cfg.top_k, sampling, generator, with_log_probs=topk > 0,
                min_p=cfg.min_p,
            )
            score = torch.full((batch, width), -1.0, device=device).index_put_((rows, columns), confidence)
            if schedule is None:
                commit = block_masked & ((score > cfg.threshold) if reference else (score >= cfg.threshold))
                best = torch.zeros_like(commit).scatter_(1, score.argmax(1, keepdim=True), True)
                commit |= best & block_masked & ~commit.any(1, keepdim=True)
            else:
                chosen = torch.topk(score, schedule[step_in_block], dim=1).indices
                commit = torch.zeros_like(block_masked).scatter_(1, chosen, True) & block_masked

            drawn = torch.zeros_like(block_masked, dtype=canvas.dtype).index_put_((rows, columns), candidate)
            canvas[:, start:end] = torch.where(commit, drawn, canvas[:, start:end])
            offset = start - prompt_len
            span = slice(offset, offset + width)  # the block in completion coordinates
            commit_step[:, span] = torch.where(commit, step, commit_step[:, span])
            commit_prob[:, span] = torch.where(commit, score, commit_prob[:, span])
            if topk:
                values, ids = log_probs.topk(topk, dim=-1)
                keep = commit[rows, columns].unsqueeze(-1)
                at = (rows, offset + columns)
                topk_ids[at] = torch.where(keep, ids, topk_ids[at])
                topk_logps[at] = torch.where(keep, values, topk_logps[at])
            if routing is not None:  # the experts of the block's positions in this step's forward
                chosen, first = routing.take(), calls.last_fed.start
                experts = chosen.view(batch, -1, *chosen.shape[1:])[:, start - first : end - first].to(torch.int16)
                if routed is None:
                    routed = torch.full((batch, decoded, *experts.shape[2:]), -1, dtype=torch.int16, device=device)
                routed[:, span] = torch.where(commit[:, :, None, None], experts, routed[:, span])
            step += 1
            step_in_block += 1

        if cfg.stop_at_eos and end < total:
            if torch.isin(canvas[:, prompt_len:end], eos_tensor).any(1).all():
                canvas[:, end:] = eos_ids[0]
                break

    canvas, commit_step, commit_prob = canvas[:, : prompt_len + gen], commit_step[:, :gen], commit_prob[:, :gen]
    if topk:
        topk_ids, topk_logps = topk_ids[:, :gen], topk_logps[:, :gen]
    completion = canvas[:, prompt_len:]
    completion_mask = completion_mask_to_eos(completion, eos_tensor)
    dense_step, num_steps = _dense_step_ranks(commit_step, step)
    return DiffusionGenerationOutput(
        sequences=canvas[:, pad:],
        completion_ids=completion,
        completion_mask=completion_mask,
        commit_step=dense_step,
        commit_prob=commit_prob,
        topk_ids=topk_ids,
        topk_logps=topk_logps,
        nfe=nfe,
        num_steps=num_steps,
        routed_experts=None if routed is None else routed[:, :gen],
    )
