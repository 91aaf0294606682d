"""Settings of the block-wise diffusion sampler (SPEC §1.1–1.3)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .._console import warn_once

CACHE_MODES = ("none", "prefix", "dual")
UNMASKING_MODES = ("dynamic", "static")
SAMPLING_STYLES = ("gumbel", "categorical")
REFERENCE_DECODERS = ("llada2",)


@dataclass
class DiffusionGenerationConfig:
    """How :func:`~dllm_trl.diffusion_generate` decodes.

    Parameters:
        gen_length (`int`, defaults to `256`):
            Number of completion positions appended to the prompt as mask tokens.
        block_length (`int`, defaults to `32`):
            Blocks are decoded left to right; `gen_length` must be a multiple of it. For a block-diffusion model
            (`config.diffusion_block_size`) it is the attention block or a sub-block of it (a divisor), and
            `gen_length` a multiple of the attention block.
        unmasking (`str`, defaults to `"dynamic"`):
            `"dynamic"`: commit every position whose confidence is ≥ `threshold` (at least one per step).
            `"static"`: commit a fixed number of the most confident positions per step (`steps` in total).
        threshold (`float`, defaults to `0.9`):
            Confidence threshold of dynamic unmasking, in (0, 1].
        steps (`int` or `None`, defaults to `None`):
            Total denoising steps of static unmasking (`None` = `gen_length`, one token per step). Must be a
            multiple of the number of blocks, with at most `block_length` steps per block.
        temperature (`float`, defaults to `0.0`):
            Sampling temperature; 0 means argmax.
        top_p (`float` or `None`, defaults to `None`):
            Nucleus truncation applied before drawing (both sampling styles).
        top_k (`int` or `None`, defaults to `None`):
            Top-k truncation applied before drawing (both sampling styles).
        min_p (`float` or `None`, defaults to `None`):
            Min-p truncation applied before drawing: tokens whose probability is below `min_p` times the most
            likely token's are dropped (both sampling styles). The three truncations run in transformers' order
            and with its warpers: temperature, then top-k, then top-p, then min-p on what top-p kept.
        sampling (`str` or `None`, defaults to `None`):
            `"gumbel"` (LLaDA style: Gumbel-max on logits/temperature in float64) or `"categorical"` (Dream
            style: softmax then a categorical draw). `None` uses the model's `config.diffusion_sampling`.
        cache (`str`, defaults to `"dual"`):
            KV cache: `"none"` (full forward every step), `"prefix"` (reuse keys/values before the block) or
            `"dual"` (reuse prefix and suffix, feed only the block). Refreshed at every block start. For a
            block-diffusion model `"prefix"` and `"dual"` are the same exact cache of the finished blocks (nothing
            after the current block is visible to it).
        record_topk (`int`, defaults to `0`):
            Also record, per committed token, the top-K ids and log-probs of the distribution it was drawn
            from (0 = off).
        record_routing (`bool`, defaults to `False`):
            Also record, per committed token of a mixture-of-experts model, the experts each MoE layer routed its
            position to in the forward of the step that committed it (`DiffusionGenerationOutput.routed_experts`),
            through hooks on the routers that exist for the call only. Off: nothing is hooked.
        stop_at_eos (`bool`, defaults to `True`):
            Stop once every row holds an EOS in its decoded blocks; the rest is filled with EOS and never
            counts as part of the completion.
        seed (`int` or `None`, defaults to `None`):
            Seed of a local `torch.Generator` (global RNG state is never touched). `None` draws from the
            global generator.
        reference_decoder (`str` or `None`, defaults to `None`):
            Reproduce a model family's own decoder. `"llada2"`: LLaDA2's `generate` (its defaults `steps =
            block_length`, greedy: token for token): blocks count from each prompt's first token, so the prompt's
            last block is shared with the first decoded tokens (the default pads the prompt to a block boundary
            instead), a position commits when its confidence is strictly above `threshold` (else the most confident
            one), and the last block is decoded whole. Needs a block-diffusion model with `block_length` = its
            block, dynamic unmasking, and a batch whose prompt lengths agree modulo the block. For evaluation: the
            training forward aligns prompts to a block boundary, so the trainers refuse it.
    """

    gen_length: int = field(default=256, metadata={"help": "Completion positions appended as mask tokens."})
    block_length: int = field(default=32, metadata={"help": "Block size; gen_length must be a multiple of it."})
    unmasking: str = field(default="dynamic", metadata={"help": "'dynamic' (threshold) or 'static' (fixed steps)."})
    threshold: float = field(default=0.9, metadata={"help": "Confidence threshold of dynamic unmasking, in (0, 1]."})
    steps: int | None = field(default=None, metadata={"help": "Total steps of static unmasking (None = gen_length)."})
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature; 0 = argmax."})
    top_p: float | None = field(default=None, metadata={"help": "Nucleus truncation before drawing."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k truncation before drawing."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p truncation before drawing."})
    sampling: str | None = field(default=None, metadata={"help": "'gumbel', 'categorical' or None (model default)."})
    cache: str = field(default="dual", metadata={"help": "KV cache mode: 'none', 'prefix' or 'dual'."})
    record_topk: int = field(default=0, metadata={"help": "Record top-K ids/log-probs per committed token (0 = off)."})
    record_routing: bool = field(
        default=False, metadata={"help": "Record the experts each committed token was routed to (MoE models)."}
    )
    stop_at_eos: bool = field(default=True, metadata={"help": "Stop once every row has an EOS in decoded blocks."})
    seed: int | None = field(default=None, metadata={"help": "Seed of a local torch.Generator."})
    reference_decoder: str | None = field(
        default=None, metadata={"help": "None, or 'llada2': reproduce LLaDA2's own generate (evaluation only)."}
    )

    def __post_init__(self):
        if self.gen_length <= 0:
            raise ValueError(f"gen_length={self.gen_length} must be positive.")
        if self.block_length <= 0 or self.gen_length % self.block_length != 0:
            raise ValueError(
                f"gen_length={self.gen_length} must be a positive multiple of block_length={self.block_length}; "
                "change one of them."
            )
        if self.unmasking not in UNMASKING_MODES:
            raise ValueError(f"unmasking={self.unmasking!r}: expected one of {UNMASKING_MODES}.")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold} must lie in (0, 1].")
        if self.unmasking == "static":
            steps = self.total_steps
            if steps < self.num_blocks or steps % self.num_blocks != 0:
                raise ValueError(
                    f"steps={steps} must be a positive multiple of the number of blocks "
                    f"({self.gen_length} / {self.block_length} = {self.num_blocks})."
                )
            if steps // self.num_blocks > self.block_length:
                raise ValueError(
                    f"steps={steps} gives {steps // self.num_blocks} steps per block but a block has only "
                    f"{self.block_length} positions; use at most {self.block_length * self.num_blocks} steps."
                )
        elif self.steps is not None:
            raise ValueError("steps is only used with unmasking='static'; leave it None for dynamic unmasking.")
        if not 0.0 <= self.temperature < float("inf"):  # also rejects NaN
            raise ValueError(f"temperature={self.temperature} must be a finite number ≥ 0.")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1].")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must lie in [0, 1] (or None).")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be ≥ 1 (or None).")
        if self.sampling is not None and self.sampling not in SAMPLING_STYLES:
            raise ValueError(f"sampling={self.sampling!r}: expected one of {SAMPLING_STYLES} or None.")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache={self.cache!r}: expected one of {CACHE_MODES}.")
        if self.record_topk < 0:
            raise ValueError(f"record_topk={self.record_topk} must be ≥ 0.")
        if self.reference_decoder is not None:
            if self.reference_decoder not in REFERENCE_DECODERS:
                raise ValueError(f"reference_decoder={self.reference_decoder!r}: expected one of {REFERENCE_DECODERS} "
                                 "or None.")
            if self.unmasking != "dynamic":
                raise ValueError(f"reference_decoder={self.reference_decoder!r} decodes with its threshold rule: "
                                 "use unmasking='dynamic'.")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def total_steps(self) -> int:
        return self.gen_length if self.steps is None else self.steps

    def check_positions(self, prompt_length: int, max_positions: int | None) -> None:
        """Warn when the canvas (``prompt_length`` columns, padding included, plus ``gen_length``) runs past the
        model's ``max_position_embeddings``: RoPE still computes there, but the model never saw those positions."""
        if max_positions is not None and prompt_length + self.gen_length > max_positions:
            warn_once(
                self, ("max_position_embeddings", max_positions),
                f"prompt + gen_length={self.gen_length} exceed the model's max_position_embeddings={max_positions}: "
                "positions past it were never trained and decode poorly. Use a shorter gen_length "
                "(max_completion_length in the trainers) or shorter prompts.",
            )

    def to_dict(self) -> dict:
        return asdict(self)
