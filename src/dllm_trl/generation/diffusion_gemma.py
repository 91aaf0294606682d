"""DiffusionGemma's rollout (uniform-noise block diffusion, SPEC §8) with the per-step record its RL loss needs.

transformers' ``DiffusionGemmaForBlockDiffusion`` decodes canvases of ``config.canvas_length`` tokens one after another.
The prompt and each finished canvas are encoded causally into a cache (encoder and decoder share their weights); the
decoder refines a canvas bidirectionally, reading that cache without writing it. A canvas starts as uniform random
tokens (there is no mask token) and runs steps ``n = N … 1``:

* logits ``/ T_n``, ``T_n = t_min + (t_max − t_min) · n / N``; ``y ~ Cat(softmax)`` at every position;
* accept set ``A_n``: the lowest-entropy positions whose entropies, summed without the largest, stay within
  ``entropy_bound`` (a deterministic function of the logits, recomputed over the whole canvas every step);
* next canvas ``= y`` on ``A_n``, fresh uniform tokens elsewhere;
* self-conditioning: the next step's decoder reads ``softmax(logits / T_n) · E · √H`` (zeros at a canvas's first step);
* a row stops early once its argmax canvas is unchanged for ``stability_threshold`` steps and its mean entropy is
  below ``confidence_threshold``; the canvas's output is the argmax of the row's last step, tokens after its first
  EOS become padding before the canvas is encoded, and a finished row's later canvases are all padding.

:class:`DiffusionGemmaSampler` reproduces ``model.generate`` token for token under the same random state (dynamic
cache, left-padded batches; the global generator when ``generator`` is None, drawing exactly what ``generate`` draws:
per canvas one ``randint(B, L)``, per step one ``multinomial`` over all ``B·L`` positions then one ``randint(B, L)``,
finished rows included) and records per lock-step step (:class:`DenoisingSteps`) what the training forward needs to
recompute the distribution each accepted token was drawn from: the canvas ``x_n``, the accept mask, the accepted
tokens and their log-probs, ``T_n``, which rows were still denoising, and the self-conditioning input.

Self-conditioning carrier (``self_conditioning``):

* ``"embedding"`` (default): the decoder's soft embedding ``softmax(prev logits) · E · √H``, (B, L, H) per step,
  captured from the decoder's own self-conditioning call. The replay feeds it back in place of the one the decoder
  would compute: the input ``π_θ`` would read from the recorded logits whenever the embedding matrix ``E`` is frozen
  (LoRA, the usual case at 26B); with ``E`` trained the replay keeps the rollout's soft embedding (the rollout's value,
  no gradient into ``E`` through that path).
  Size at the 26B-A4B shape (H = 2816), batch 8 × 256 positions × 16 recorded steps: 2 bytes (bf16) × 8 × 256 × 2816 ×
  16 = 184.5 MB (369 MB in float32); the sampler keeps every step of the rollout (N per canvas) until
  ``sample_states`` keeps the sampled ones.
* ``"logits"``: the previous step's temperature-scaled logits themselves, (B, L, V): the rollout's input for any
  trained weights (its softmax · E taken with the current ``E``), but
  V = 262 144 makes it 8 × 256 × 262 144 × 2 bytes = 1.07 GB per step in bf16 (17.2 GB for 16 steps); for small
  vocabularies and tests.

With either carrier, :func:`replay_logits` feeds the recorded input as a constant: the replayed logits are
``π_θ(· | x_n, sc_rec, T_n)``, and no gradient runs through the self-conditioning chain (step n+1's logits feeding step
n's input; steps count down). Given a :class:`SelfConditioningChain` instead, it recomputes each state's input with
gradient from the replay of its canvas's earlier steps (from the canvas's first step, whose input is zeros, each step
reading its recorded canvas ``x`` and the previous recomputed input): ``π_θ(· | x_n, sc_n(θ), T_n)``, at the cost of
one decoder call per earlier step of the canvas; the carrier's record is then not read.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..models.diffusion_gemma import is_diffusion_gemma
from ..models.engines import LockStep, forward_replacing, unwrap_model
from .masked_diffusion import NEVER_COMMITTED, DiffusionGenerationOutput, completion_mask_to_eos
from .trajectory import DenoisingSteps

SELF_CONDITIONING_CARRIERS = ("embedding", "logits")


@dataclass
class DiffusionGemmaSamplerConfig:
    """How :class:`DiffusionGemmaSampler` decodes (``model.generate``'s defaults unless said).

    Parameters:
        gen_length (`int`, defaults to `256`):
            Completion tokens: a multiple of the model's `canvas_length` (canvases are decoded whole).
        max_denoising_steps (`int`, defaults to `48`):
            `N`, denoising steps per canvas (fewer when a row stops early).
        entropy_bound (`float`, defaults to `0.1`):
            Accept the lowest-entropy positions while their entropies, summed without the largest, stay ≤ this bound.
        t_min (`float`, defaults to `0.4`):
            Temperature of the last step.
        t_max (`float`, defaults to `0.8`):
            Temperature of the first step (linear in between).
        stability_threshold (`int`, defaults to `1`):
            Steps for which a row's argmax canvas must be unchanged before it may stop early.
        confidence_threshold (`float`, defaults to `0.005`):
            A row stops early when stable and its mean entropy (of the temperature-scaled logits) is below this.
        eos_token_id (`int`, `list[int]` or `None`, defaults to `None`):
            EOS ids (`None`: the model's text config's).
        pad_token_id (`int` or `None`, defaults to `None`):
            Padding written after a row's first EOS (`None`: the model's text config's).
        self_conditioning (`str`, defaults to `"embedding"`):
            What the record keeps of each step's self-conditioning input: `"embedding"` (the (B, L, H) soft
            embedding, replays the rollout's input exactly while the embeddings are frozen) or `"logits"` (the
            (B, L, V) logits, always). Either is a constant of the loss forward (no gradient through the
            self-conditioning chain unless the loss recomputes it: `self_conditioning_gradient="chain"`).
        record_topk (`int`, defaults to `0`):
            Also record, per step and position, the top-K ids and log-probs of the tempered distribution the tokens
            were drawn from (the behaviour distribution of the trust-region loss; 0 = off).
    """

    gen_length: int = field(default=256, metadata={"help": "Completion tokens, a multiple of the canvas length."})
    max_denoising_steps: int = field(default=48, metadata={"help": "N: denoising steps per canvas."})
    entropy_bound: float = field(default=0.1, metadata={"help": "Entropy bound of the accept set."})
    t_min: float = field(default=0.4, metadata={"help": "Temperature of the last denoising step."})
    t_max: float = field(default=0.8, metadata={"help": "Temperature of the first denoising step."})
    stability_threshold: int = field(default=1, metadata={"help": "Unchanged argmax steps before an early stop."})
    confidence_threshold: float = field(default=0.005, metadata={"help": "Mean entropy below which a row may stop."})
    eos_token_id: int | list[int] | None = field(default=None, metadata={"help": "EOS ids (None: the model's)."})
    pad_token_id: int | None = field(default=None, metadata={"help": "Padding after EOS (None: the model's)."})
    self_conditioning: str = field(
        default="embedding",
        metadata={"help": "Self-conditioning record: 'embedding' (B,L,H; exact with frozen embeddings) or 'logits'.",
                  "choices": list(SELF_CONDITIONING_CARRIERS)},
    )

    record_topk: int = field(default=0, metadata={"help": "Top-K of each step's tempered distribution to record."})

    def __post_init__(self):
        if self.gen_length <= 0:
            raise ValueError(f"gen_length={self.gen_length} must be positive.")
        if self.max_denoising_steps < 1:
            raise ValueError(f"max_denoising_steps={self.max_denoising_steps} must be ≥ 1.")
        if not self.entropy_bound > 0:
            raise ValueError(f"entropy_bound={self.entropy_bound} must be > 0.")
        if not 0 <= self.t_min < self.t_max:
            raise ValueError(f"the temperatures must satisfy 0 ≤ t_min < t_max (got {self.t_min}, {self.t_max}).")
        if self.stability_threshold < 0 or not self.confidence_threshold > 0:
            raise ValueError("stability_threshold must be ≥ 0 and confidence_threshold > 0.")
        if self.self_conditioning not in SELF_CONDITIONING_CARRIERS:
            raise ValueError(f"self_conditioning={self.self_conditioning!r}: expected one of "
                             f"{SELF_CONDITIONING_CARRIERS}.")


@dataclass
class SelfConditioningChain:
    """What :func:`replay_logits` needs to recompute the self-conditioning input of a state through the steps before
    it: per row (R) of the replay, the rollout's record of every lock-step step (S) and, per state, its step.

    ``steps`` (R, k): the record step of each state (as :class:`DenoisingSteps` counts, over all canvases).
    ``state_ids`` (R, S, L): the canvas ``x`` each step's decoder read. ``canvas`` (R, S): the canvas each step
    refines. ``temperature`` (R, S) float32: ``T`` of each step (its tempered logits are the next step's input).
    """

    steps: torch.Tensor
    state_ids: torch.Tensor
    canvas: torch.Tensor
    temperature: torch.Tensor


def step_temperature(config: DiffusionGemmaSamplerConfig, remaining: int, device) -> torch.Tensor:
    """``T_n`` as ``generate`` computes it: ``n`` as an int32 tensor, so the division runs in float32."""
    n = torch.tensor(remaining, dtype=torch.int32, device=device)
    return config.t_min + (config.t_max - config.t_min) * (n / config.max_denoising_steps)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, as ``torch.distributions.Categorical`` computes it (the accept
    set and the stopping rule compare these values, so they must match ``generate``'s to the bit)."""
    return torch.distributions.Categorical(logits=logits).entropy()


def entropy_bound_accept(logits: torch.Tensor, bound: float) -> torch.Tensor:
    """(B, L) bool: the accept set — positions sorted by entropy ascending, kept while the running sum of their
    entropies minus the current (largest so far) one is ≤ ``bound``."""
    entropy = token_entropy(logits)
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    keep = ordered.cumsum(-1) - ordered <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


def cache_keyword(model) -> str:
    """The name DiffusionGemma's forwards and mask builders give the KV cache: ``past_key_values`` up to transformers
    5.2x, ``cache`` after its rename (the old name warns until it is removed)."""
    forward = unwrap_model(model).model.decoder.forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class _Calls:
    """The encoder and decoder calls of a DiffusionGemma model, laid out as ``generate`` lays them out: positions are
    column indices shared by the batch (left padding included, hidden by the key mask), the masks come from the
    model's own mask builders. Encoder and decoder submodules are called inside the wrapped model's own forward
    (:func:`~dllm_trl.models.engines.forward_replacing`), so every engine's hooks run around them."""

    def __init__(self, model):
        self.wrapped = model
        self.model = unwrap_model(model)
        self.config = self.model.config
        self.text = self.config.get_text_config()
        self.canvas_length = self.config.canvas_length
        self.encoder = self.model.model.encoder
        self.decoder = self.model.model.decoder
        self.cache_keyword = cache_keyword(self.model)

    def new_cache(self):
        return DynamicCache(config=self.config.get_text_config(decoder=True))

    def inside_forward(self, hidden_fn):
        """The model's logits (its own head and soft-capping) on the hidden states ``hidden_fn()`` returns, computed
        inside one forward of the wrapped model."""
        from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaModelOutputWithPast

        output = forward_replacing(self.wrapped, self.model.model,
                                   lambda: DiffusionGemmaModelOutputWithPast(last_hidden_state=hidden_fn()))
        return output.logits

    def encode(self, cache, ids: torch.Tensor, attention: torch.Tensor, start: int) -> None:
        """Append ``ids`` (B, n), at positions ``start …``, to ``cache``; ``attention`` (B, start + n) are its keys.
        Call it inside a forward (:meth:`inside_forward`); :meth:`encode_alone` is one forward of its own."""
        positions = torch.arange(start, start + ids.shape[1], dtype=torch.int32, device=ids.device).unsqueeze(0)
        shape_only = torch.empty(ids.shape[0], ids.shape[1], 0, dtype=self.model.dtype, device=ids.device)
        masks = self.encoder.create_masks_for_generate(config=self.config, inputs_embeds=shape_only,
                                                       attention_mask=attention, **{self.cache_keyword: cache},
                                                       position_ids=positions)
        self.encoder(input_ids=ids.contiguous(), attention_mask=masks, position_ids=positions,
                     **{self.cache_keyword: cache})

    def encode_alone(self, cache, ids: torch.Tensor, attention: torch.Tensor, start: int) -> None:
        def run():
            self.encode(cache, ids, attention, start)
            return torch.zeros(ids.shape[0], 0, self.text.hidden_size, dtype=self.model.dtype, device=ids.device)

        self.inside_forward(run)

    def idle_step(self, cache, canvas: torch.Tensor, start: int, attention: torch.Tensor) -> None:
        """A decoding step's calls on the first row alone, its logits dropped: the partner of another process's step
        (the self-conditioning block runs with or without a signal, so none is passed)."""
        row = torch.zeros(1, dtype=torch.long, device=canvas.device)
        view = select_cache_rows(cache, row)
        self.logits(view, canvas[:1], start, self.decoder_mask(view, canvas[:1], attention[:1]))

    def decoder_mask(self, cache, canvas: torch.Tensor, attention: torch.Tensor):
        return self.decoder.create_diffusion_decoder_attention_mask(
            config=self.config, inputs_embeds=canvas.unsqueeze(-1), **{self.cache_keyword: cache},
            decoder_attention_mask=attention,
        )

    def logits(self, cache, canvas, start: int, mask, self_conditioning_logits=None, self_conditioning_mask=None):
        """(B, L, V) float32 logits of the decoder on ``canvas`` at positions ``start …`` over ``cache``."""
        positions = torch.arange(start, start + canvas.shape[1], dtype=torch.int32, device=canvas.device).unsqueeze(0)
        return self.model(decoder_input_ids=canvas, self_conditioning_logits=self_conditioning_logits,
                          self_conditioning_mask=self_conditioning_mask, decoder_attention_mask=mask,
                          decoder_position_ids=positions, **{self.cache_keyword: cache}).logits

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(…, V) float32 logits of decoder hidden states, as the model's forward computes them after its inner model
        (its LM head, then the final soft-capping): for logits needed inside a forward (the self-conditioning chain)."""
        logits = self.model.lm_head(hidden).float()
        cap = self.model.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def decode(self, cache, canvas, start: int, mask, self_conditioning_logits=None, self_conditioning_mask=None):
        """(B, L, H) decoder hidden states on ``canvas`` at positions ``start …`` over ``cache`` (inside a forward)."""
        positions = torch.arange(start, start + canvas.shape[1], dtype=torch.int32, device=canvas.device).unsqueeze(0)
        return self.decoder(decoder_input_ids=canvas, self_conditioning_logits=self_conditioning_logits,
                            self_conditioning_mask=self_conditioning_mask, decoder_attention_mask=mask,
                            decoder_position_ids=positions, **{self.cache_keyword: cache}).last_hidden_state

    @contextlib.contextmanager
    def soft_embedding_hook(self, replace: torch.Tensor | None = None, record: list | None = None):
        """Around decoder calls: ``record`` the soft embedding the decoder's self-conditioning block receives, or
        ``replace`` it with a given (B, L, H) tensor."""

        def hook(module, args):
            embeds, signal = args
            if record is not None:
                record.append(signal.detach())
            return (embeds, replace.to(signal.dtype)) if replace is not None else None

        handle = self.decoder.self_conditioning.register_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()


def select_cache_rows(cache, rows: torch.Tensor):
    """A read-only view of ``cache`` holding the batch rows ``rows`` (repeats allowed), for decoder calls, which read
    the cache without writing it. The layers' keys and values are indexed (autograd flows through them)."""
    view = copy.copy(cache)
    view.layers = []
    for layer in cache.layers:
        part = copy.copy(layer)
        part.keys, part.values = layer.keys[rows], layer.values[rows]
        view.layers.append(part)
    return view


def _eos_and_pad(config: DiffusionGemmaSamplerConfig, text_config) -> tuple[list[int], int]:
    eos = config.eos_token_id if config.eos_token_id is not None else text_config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else text_config.pad_token_id
    if eos is None or pad is None:
        raise ValueError("DiffusionGemma decoding needs an EOS and a padding id: set eos_token_id / pad_token_id on "
                         "the sampler config or on the model's text config.")
    return ([int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]), int(pad)


def check_sampler_model(config: DiffusionGemmaSamplerConfig, model) -> None:
    """Refuse a model that is not DiffusionGemma, and a length that is not whole canvases."""
    if not is_diffusion_gemma(model):
        raise ValueError(f"DiffusionGemmaSampler decodes transformers' DiffusionGemmaForBlockDiffusion; got "
                         f"{type(unwrap_model(model)).__name__}. Use MaskedDiffusionSampler for masked-diffusion models.")
    canvas = unwrap_model(model).config.canvas_length
    if config.gen_length % canvas:
        raise ValueError(f"gen_length={config.gen_length} is not a multiple of the model's canvas_length={canvas}: "
                         f"DiffusionGemma decodes whole canvases; set gen_length (max_completion_length) to a multiple "
                         f"of {canvas}.")


class DiffusionGemmaSampler:
    """The rollout of DiffusionGemma (module docstring): same call and output type as
    :class:`~dllm_trl.generation.MaskedDiffusionSampler`, with the per-step record in ``denoising_steps``
    (:class:`~dllm_trl.generation.trajectory.DenoisingSteps`). In the output, ``commit_step`` (B, G) is the row's
    (dense) step whose argmax fixed each position's output token (its canvas's last step; ``NEVER_COMMITTED`` for
    canvases the row never decoded) and ``commit_prob`` that token's probability there."""

    def __init__(self, config: DiffusionGemmaSamplerConfig):
        self.config = config

    def check_model(self, model) -> None:
        check_sampler_model(self.config, model)

    @torch.no_grad()
    def __call__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> DiffusionGenerationOutput:
        """Left-padded prompts (B, P) → completions (B, gen_length) and their trajectory. ``generator``: None draws
        from the global generator, as ``model.generate`` does."""
        cfg = self.config
        self.check_model(model)
        calls = _Calls(model)
        eos_ids, pad_id = _eos_and_pad(cfg, calls.text)
        batch, prompt_len = prompt_ids.shape
        device = prompt_ids.device
        length, vocab, steps = calls.canvas_length, calls.text.vocab_size, cfg.max_denoising_steps
        num_canvases = cfg.gen_length // length
        attention = torch.ones_like(prompt_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
        eos = torch.tensor(eos_ids, device=device)
        embedding_dtype = calls.decoder.embed_tokens.weight.dtype

        cache = calls.new_cache()
        completion = torch.full((batch, cfg.gen_length), pad_id, dtype=prompt_ids.dtype, device=device)
        commit_at = torch.full((batch, cfg.gen_length), NEVER_COMMITTED, dtype=torch.long, device=device)
        commit_prob = torch.zeros(batch, cfg.gen_length, device=device)
        sequence_done = torch.zeros(batch, dtype=torch.bool, device=device)
        record = {name: [] for name in ("canvas", "temperature", "has_sc", "state", "accept", "accepted", "logps",
                                        "active", "sc", "topk_ids", "topk_logps")}
        # Rows stop early, so a process may finish a canvas, or the whole rollout, before another: under engines whose
        # forwards are collectives it then runs idle forwards (one row, no random draw) while any process still
        # decodes, the same calls in the same order (SPEC §9).
        lock = LockStep(model)
        chunk, start = prompt_ids, 0
        for c in range(num_canvases):
            idle = bool(sequence_done.all())  # only reached in lock-step: another process still decodes
            if idle:
                cache, start, attention = calls.new_cache(), 0, attention[:1, :1]
                chunk, canvas = chunk[:1, :1], torch.zeros(1, length, dtype=prompt_ids.dtype, device=device)
            calls.encode_alone(cache, chunk, attention, start)
            start += chunk.shape[1]
            if not idle:
                canvas = torch.randint(0, vocab, (batch, length), device=device, generator=generator)
            decoder_attention = torch.nn.functional.pad(attention, (0, length), value=True)
            mask = calls.decoder_mask(cache, canvas, decoder_attention)
            sc_logits, argmax, done = None, canvas, torch.zeros(batch, dtype=torch.bool, device=device)
            history = None  # the last `stability_threshold` argmax canvases
            for remaining in range(steps, 0, -1):
                if idle or done.all():  # lock-step only: a partner for another process's step
                    calls.idle_step(cache, canvas, start, decoder_attention)
                    if lock.any_process(False):
                        continue
                    break
                active = ~done & ~sequence_done
                captured = []
                with calls.soft_embedding_hook(record=captured if cfg.self_conditioning == "embedding" else None):
                    logits = calls.logits(cache, canvas, start, mask, sc_logits)
                temperature = step_temperature(cfg, remaining, device)
                scaled = logits / temperature
                probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
                drawn = torch.multinomial(probs.view(-1, vocab), 1, generator=generator).view(batch, length)
                new_argmax = scaled.argmax(-1)
                accept = entropy_bound_accept(scaled, cfg.entropy_bound)
                accepted = torch.where(accept, drawn, canvas)
                noise = torch.randint(0, vocab, (batch, length), device=device, generator=generator)
                new_canvas = torch.where(accept, accepted, noise)
                logps = scaled.gather(-1, drawn.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)

                record["canvas"].append(c)
                record["temperature"].append(temperature.float())
                record["has_sc"].append(sc_logits is not None)
                record["state"].append(canvas)
                record["accept"].append(accept)
                record["accepted"].append(accepted)
                record["logps"].append(torch.where(accept, logps, 0.0))
                record["active"].append(active)
                if cfg.record_topk:
                    values, ids = scaled.topk(cfg.record_topk, dim=-1)
                    record["topk_ids"].append(ids.to(torch.int32))
                    record["topk_logps"].append(values - scaled.logsumexp(-1, keepdim=True))
                if cfg.self_conditioning == "embedding":
                    record["sc"].append(captured[0].to(embedding_dtype))
                else:
                    record["sc"].append(torch.zeros_like(scaled, dtype=embedding_dtype) if sc_logits is None
                                        else sc_logits)

                # A row that stopped keeps its canvas, argmax and self-conditioning (generate's bookkeeping).
                frozen = done.unsqueeze(-1)
                new_argmax = torch.where(frozen, argmax, new_argmax)
                new_canvas = torch.where(frozen, canvas, new_canvas)
                if sc_logits is not None:
                    scaled = torch.where(frozen.unsqueeze(-1), sc_logits, scaled)
                top_prob = probs.gather(-1, new_argmax.unsqueeze(-1)).squeeze(-1)
                span = slice(c * length, (c + 1) * length)
                commit_prob[:, span] = torch.where(active.unsqueeze(-1), top_prob, commit_prob[:, span])
                if cfg.stability_threshold == 0:
                    stable = torch.ones(batch, dtype=torch.bool, device=device)
                else:
                    if history is None:
                        history = torch.full((cfg.stability_threshold, batch, length), -1, dtype=new_argmax.dtype,
                                             device=device)
                    stable = (history == new_argmax.unsqueeze(0)).all(-1).all(0)
                    history = torch.cat([history[1:], new_argmax.unsqueeze(0)])
                confident = token_entropy(scaled).mean(-1) < cfg.confidence_threshold
                done = done | (stable & confident)
                sc_logits = scaled.to(embedding_dtype)
                canvas, argmax = new_canvas, new_argmax
                if not lock.any_process(not done.all()):
                    break
            if not idle:
                # The canvas's output: pad after the first EOS; rows finished in an earlier canvas are all padding.
                output = argmax.clone()
                output[sequence_done] = pad_id
                is_eos = torch.isin(output, eos)
                seen = is_eos.cumsum(-1)
                output[(seen > 0) & ~((seen == 1) & is_eos)] = pad_id
                completion[:, c * length : (c + 1) * length] = output
                sequence_done = sequence_done | is_eos.any(-1)
                attention = torch.nn.functional.pad(attention, (0, length), value=True)
                chunk = output
            if not lock.any_process(not sequence_done.all()):
                break

        steps_record = DenoisingSteps(
            canvas=torch.tensor(record["canvas"], dtype=torch.long, device=device),
            temperature=torch.stack(record["temperature"]),
            has_self_conditioning=torch.tensor(record["has_sc"], dtype=torch.bool, device=device),
            state_ids=torch.stack(record["state"], dim=1),
            accept_mask=torch.stack(record["accept"], dim=1),
            accepted_ids=torch.stack(record["accepted"], dim=1),
            accepted_logps=torch.stack(record["logps"], dim=1),
            active=torch.stack(record["active"], dim=1),
            self_conditioning=torch.stack(record["sc"], dim=1),
            carrier=cfg.self_conditioning,
            topk_ids=torch.stack(record["topk_ids"], dim=1) if cfg.record_topk else None,
            topk_logps=torch.stack(record["topk_logps"], dim=1) if cfg.record_topk else None,
        )
        # Dense per-row step numbers; a canvas's positions are fixed by the row's last active step in it.
        active = steps_record.active
        dense = active.long().cumsum(1) - 1
        for c in range(int(steps_record.canvas.max().item()) + 1):
            in_canvas = active & (steps_record.canvas == c).unsqueeze(0)
            last = torch.where(in_canvas, dense, -1).amax(1)
            span = slice(c * length, (c + 1) * length)
            commit_at[:, span] = torch.where((last >= 0).unsqueeze(-1), last.unsqueeze(-1), NEVER_COMMITTED)
        return DiffusionGenerationOutput(
            sequences=torch.cat([prompt_ids, completion], dim=1),
            completion_ids=completion,
            completion_mask=completion_mask_to_eos(completion, eos),
            commit_step=commit_at,
            commit_prob=commit_prob,
            topk_ids=None,
            topk_logps=None,
            nfe=len(record["canvas"]),
            num_steps=active.sum(1),
            denoising_steps=steps_record,
        )


def decode_through_chain(calls, cache, attention, start: int, rows, slots, chain: SelfConditioningChain):
    """Decoder hidden states (n, L, H) of the states ``(rows, slots)`` of one canvas, each state's self-conditioning
    input recomputed (with gradient when enabled) by the canvas's steps before it: its first step reads zeros, every
    later one its recorded canvas and the tempered logits ``logits / T`` of the step before (cast to the embeddings'
    dtype, as the rollout fed them). Rows with several states share one chain, run up to their latest state;
    ``attention`` (R, start) are the keys of ``cache``, which holds the prompt and the canvases before this one."""
    length = calls.canvas_length
    steps = chain.steps[rows, slots]
    own_canvas = chain.canvas[rows, steps]
    first = (chain.canvas[rows] == own_canvas.unsqueeze(1)).int().argmax(1)  # the canvas's first step, per state
    depth = steps - first
    chain_rows, state_chain = torch.unique(rows, return_inverse=True)
    need = torch.zeros_like(chain_rows).scatter_reduce(0, state_chain, depth, "amax", include_self=False)
    start_step = torch.zeros_like(chain_rows).scatter(0, state_chain, first)
    embedding_dtype = calls.decoder.embed_tokens.weight.dtype
    hidden = [None] * rows.numel()
    alive = torch.arange(chain_rows.numel(), device=rows.device)  # chains still running, as indices of chain_rows
    previous = None  # the tempered logits of the last step of the chains in `alive`
    for p in range(int(need.max().item()) + 1):
        keep = need[alive] >= p
        alive, previous = alive[keep], None if previous is None else previous[keep]
        r, step = chain_rows[alive], start_step[alive] + p
        ids = chain.state_ids[r, step]
        view = select_cache_rows(cache, r)
        mask = calls.decoder_mask(view, ids, torch.nn.functional.pad(attention[r], (0, length), value=True))
        out = calls.decode(view, ids, start, mask, self_conditioning_logits=previous)
        at_state = (depth == p).nonzero().squeeze(1)
        position = torch.searchsorted(alive, state_chain[at_state])  # `alive` is sorted
        for i, k in zip(at_state.tolist(), position.tolist()):
            hidden[i] = out[k]
        if p < int(need[alive].max().item()):
            temperature = chain.temperature[r, step].view(-1, 1, 1)
            previous = (calls.head(out) / temperature).to(embedding_dtype)
    return torch.stack(hidden)


def decode_recorded(calls, cache, attention, start: int, canvas_ids, sc, present, rows, carrier: str):
    """Decoder hidden states (n, L, H) of states of one canvas, rows ``rows`` of ``cache``, each fed its recorded
    self-conditioning input ``sc`` (zeros where ``present`` is False) as a constant."""
    view = select_cache_rows(cache, rows)
    decoder_attention = torch.nn.functional.pad(attention[rows], (0, calls.canvas_length), value=True)
    mask = calls.decoder_mask(view, canvas_ids, decoder_attention)
    if carrier == "embedding":
        with calls.soft_embedding_hook(replace=sc * present.to(sc.dtype)[:, None, None]):
            return calls.decode(view, canvas_ids, start, mask)
    return calls.decode(view, canvas_ids, start, mask, self_conditioning_logits=sc, self_conditioning_mask=present)


def replay_logits(model, prompt_ids, prompt_mask, completion_ids, canvas, state_ids, self_conditioning,
                  has_self_conditioning, carrier: str, chain: SelfConditioningChain | None = None) -> torch.Tensor:
    """The decoder's logits (n, L, V) at ``n`` recorded states, recomputed as the rollout computed them (with
    gradient when enabled), in one forward of the wrapped ``model``: the states' rows' prompts and finished canvases
    are encoded chunk by chunk as ``generate`` encoded them, and each state's decoder call reads the cache of the
    canvases before its own.

    ``prompt_ids`` / ``prompt_mask`` (R, P) and ``completion_ids`` (R, G): the rows, at the rollout's prompt width.
    Per state, flattened over (row, slot): ``canvas`` (R, k) canvas index (−1: no state), ``state_ids`` (R, k, L),
    ``self_conditioning`` (R, k, L, H or V), ``has_self_conditioning`` (R, k): the recorded input, a constant of the
    forward. With ``chain``, the self-conditioning input is recomputed through the canvas's earlier steps instead
    (:func:`decode_through_chain`; ``self_conditioning``, ``has_self_conditioning`` and ``carrier`` are not read).
    Returns logits for the states in row-major order of ``canvas >= 0``.
    """
    calls = _Calls(model)
    length = calls.canvas_length
    rows, slots = (canvas >= 0).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return torch.zeros(0, length, calls.text.vocab_size, device=prompt_ids.device)

    def replay():
        cache = calls.new_cache()
        attention = prompt_mask.bool()
        calls.encode(cache, prompt_ids, attention, 0)
        start = prompt_ids.shape[1]
        last = int(canvas.max().item())
        hidden, order = [], []
        for c in range(last + 1):
            here = (canvas[rows, slots] == c).nonzero().squeeze(1)
            if here.numel():
                r, j = rows[here], slots[here]
                order.append(here)
                if chain is not None:
                    hidden.append(decode_through_chain(calls, cache, attention, start, r, j, chain))
                else:
                    hidden.append(decode_recorded(calls, cache, attention, start, state_ids[r, j],
                                                  self_conditioning[r, j], has_self_conditioning[r, j], r, carrier))
            if c < last:
                attention = torch.nn.functional.pad(attention, (0, length), value=True)
                calls.encode(cache, completion_ids[:, c * length : (c + 1) * length], attention, start)
                start += length
        return torch.cat(hidden)[torch.cat(order).argsort()]  # canvas order → the states' row-major order

    return calls.inside_forward(replay)
