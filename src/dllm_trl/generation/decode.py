"""Prompts -> completion texts: the batched decoding loop that every evaluation shares.

The text-level wrapper around :func:`~dllm_trl.generation.diffusion_generate` (which takes and returns tensors):
:func:`encode_prompts` left-pads plain or chat prompts, :func:`decode_prompts` runs the sampler over batches of
prompts of similar length and times it, and :func:`decode_completions` turns each completion back into text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .config import DiffusionGenerationConfig
from .masked_diffusion import diffusion_generate

BatchGenerate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]]
"""``(input_ids, attention_mask) -> (completion_ids, completion_mask, nfe)`` for one batch of encoded prompts."""


def encode_prompts(tokenizer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` tensors for plain-text or chat-message prompts.

    A chat prompt (list of messages) goes through the chat template with the assistant turn opened; a plain
    string is tokenized as is.
    """
    rows = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        if isinstance(p, list)
        else tokenizer(p, add_special_tokens=False)["input_ids"]
        for p in prompts
    ]
    padded = tokenizer.pad({"input_ids": rows}, padding=True, padding_side="left", return_tensors="pt")
    return padded["input_ids"], padded["attention_mask"]


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """Completion texts up to (not including) the first EOS."""
    eos = tokenizer.eos_token_id
    return [
        tokenizer.decode([t for t in ids[mask.bool()].tolist() if t != eos], skip_special_tokens=False)
        for ids, mask in zip(completion_ids, completion_mask)
    ]


@dataclass
class DecodedPrompts:
    """What :func:`decode_prompts` produced, over all batches."""

    completions: list[str]
    """One text per prompt, in the order of the prompts."""
    tokens: int
    """Completion tokens up to and including EOS."""
    seconds: float
    """Sampler time (encoding and text decoding excluded)."""
    nfe: int
    """Model forwards, all batches together."""
    nfe_per_prompt: float
    """Forwards each prompt's decoding went through (its batch's), averaged over prompts."""


def _prompt_length(prompt) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(message["content"]) for message in prompt)


def decode_prompts(
    model,
    tokenizer,
    prompts: Sequence,
    config: DiffusionGenerationConfig | None = None,
    batch_size: int = 16,
    *,
    generate: BatchGenerate | None = None,
    on_batch: Callable[[int], object] | None = None,
) -> DecodedPrompts:
    """Decode every prompt (a string or a list of chat messages) with :func:`diffusion_generate` under ``config``,
    ``batch_size`` prompts at a time; batches group prompts of similar length (less padding).

    ``generate`` replaces the diffusion sampler for another kind of model (e.g. a causal LM's greedy
    ``model.generate``); ``on_batch(n)`` is called after each batch with its number of prompts (a progress bar's
    ``update``). The model runs in eval mode without gradients and gets its training mode back at the end.
    """
    if (config is None) == (generate is None):
        raise ValueError("decode_prompts needs exactly one of `config` (diffusion sampling) and `generate`.")
    if generate is None:

        def generate(input_ids, attention_mask):
            out = diffusion_generate(model, input_ids, attention_mask, config)
            return out.completion_ids, out.completion_mask, out.nfe

    device = model.get_input_embeddings().weight.device
    order = sorted(range(len(prompts)), key=lambda i: _prompt_length(prompts[i]))
    completions: list[str] = [""] * len(prompts)
    tokens, seconds, nfe, prompt_forwards = 0, 0.0, 0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for begin in range(0, len(order), batch_size):
                rows = order[begin : begin + batch_size]
                input_ids, attention_mask = encode_prompts(tokenizer, [prompts[i] for i in rows])
                start = time.perf_counter()
                completion_ids, completion_mask, batch_nfe = generate(input_ids.to(device), attention_mask.to(device))
                completion_ids, completion_mask = completion_ids.cpu(), completion_mask.cpu()
                seconds += time.perf_counter() - start
                for i, text in zip(rows, decode_completions(tokenizer, completion_ids, completion_mask)):
                    completions[i] = text
                tokens += int(completion_mask.sum())
                nfe += batch_nfe
                prompt_forwards += batch_nfe * len(rows)
                if on_batch is not None:
                    on_batch(len(rows))
    finally:
        model.train(was_training)
    return DecodedPrompts(completions, tokens, seconds, nfe, prompt_forwards / max(len(prompts), 1))
