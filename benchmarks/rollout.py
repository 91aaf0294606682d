"""Rollout throughput of the diffusion sampler: KV cache none / prefix / dual × static / dynamic unmasking.

Prints one Markdown table per run: tokens/s, forward passes (NFE), seconds, speed-up over no cache for the
same unmasking (measured in this same run), peak accelerator memory, the average number of tokens a row
commits per step, and how many tokens agree with the uncached decode (caches are an approximation with
more than one layer).

    python benchmarks/rollout.py                                    # CPU: small LLaDA-shaped model
    python benchmarks/rollout.py --shape llada-8b --device cuda     # 8B-shaped, random bf16 weights

Random weights. Two things make them behave like a trained model for timing purposes:

* ``--logit-std``: a random model's logits are nearly uniform over the vocabulary, so the dynamic
  threshold never fires and dynamic unmasking degenerates into one token per step. The LM head is
  rescaled (once, after building) so that the logits at masked positions have this standard deviation;
  confidences then spread over (0, 1) and several tokens clear the threshold per step. The table reports
  the resulting tokens per step (LLaDA-8B at threshold 0.9 commits about 2–4 per step on GSM8K).
* ``stop_at_eos=False``: every row decodes all ``--gen-length`` positions.

Static unmasking uses ``--steps`` (default ``gen_length // 2``: two tokens per step).
Greedy decoding (temperature 0), as in evaluation.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from dllm_trl.generation import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.models import (
    DREAM_7B_SHAPE,
    LLADA_8B_SHAPE,
    set_diffusion_properties,
    tiny_dream_config,
    tiny_llada_config,
)

SMALL_SHAPE = dict(
    LLADA_8B_SHAPE, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4,
)
SHAPES = {"small": ("llada", SMALL_SHAPE), "llada-8b": ("llada", LLADA_8B_SHAPE), "dream-7b": ("dream", DREAM_7B_SHAPE)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--vocab", type=int, default=None, help="Override the shape's vocabulary size.")
    parser.add_argument("--layers", type=int, default=None, help="Override the shape's number of layers.")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=None, help="Static unmasking steps (default gen_length // 2).")
    parser.add_argument("--caches", default="none,prefix,dual")
    parser.add_argument("--unmasking", default="dynamic,static")
    parser.add_argument("--logit-std", type=float, default=25.0, help="Sharpen the random LM head (see above).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="Default: bfloat16 on GPU, float32 on CPU.")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the model.")
    parser.add_argument("--repeats", type=int, default=1, help="Timed runs per mode (interleaved; the best counts).")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.dtype = DTYPES[args.dtype or ("float32" if args.device == "cpu" else "bfloat16")]
    args.steps = args.steps or args.gen_length // 2
    return args


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(args):
    """The random model, created directly on ``args.device`` in ``args.dtype`` (8B never touches the CPU)."""
    family, shape = SHAPES[args.shape]
    shape = dict(shape)
    if args.vocab is not None:
        shape["vocab_size"] = args.vocab
        if shape["mask_token_id"] >= args.vocab:
            shape.update(mask_token_id=args.vocab - 1, eos_token_id=args.vocab - 2)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    make_config, model_cls = (tiny_llada_config, LlamaForCausalLM) if family == "llada" else (tiny_dream_config, Qwen2ForCausalLM)
    config = make_config(**shape)
    config._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    with torch.device(args.device), default_dtype(args.dtype):
        model = model_cls(config)
    model.eval().requires_grad_(False)
    return set_diffusion_properties(
        model, mask_token_id=shape["mask_token_id"], logit_shift=family == "dream",
        sampling="gumbel" if family == "llada" else "categorical",
    )


@torch.no_grad()
def sharpen(model, prompts, logit_std: float):
    """Rescale the LM head so the logits at masked positions have standard deviation ``logit_std``."""
    mask_id = model.config.mask_token_id
    canvas = torch.cat([prompts, torch.full((prompts.shape[0], 32), mask_id, device=prompts.device)], dim=1)
    logits = model(input_ids=canvas, logits_to_keep=32).logits.float()
    model.get_output_embeddings().weight.mul_(logit_std / logits.std().item())


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, prompts, cfg, device):
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    start = time.perf_counter()
    out = diffusion_generate(model, prompts, generation_config=cfg)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if is_cuda else float("nan")
    return out, seconds, peak


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    vocab = model.get_output_embeddings().weight.shape[0]
    special = {model.config.mask_token_id, *([model.config.eos_token_id] if isinstance(model.config.eos_token_id, int) else model.config.eos_token_id)}
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_length), generator=generator)
    for token in special:  # keep special tokens out of the prompts
        prompts[prompts == token] = (token + 1) % vocab
    prompts = prompts.to(args.device)
    sharpen(model, prompts, args.logit_std)

    caches = args.caches.split(",")
    unmaskings = args.unmasking.split(",")
    modes = [(u, c) for u in unmaskings for c in caches]

    def config(unmasking, cache, gen_length=args.gen_length):
        return DiffusionGenerationConfig(
            gen_length=gen_length, block_length=args.block_length, unmasking=unmasking, threshold=args.threshold,
            steps=(args.steps * gen_length // args.gen_length) if unmasking == "static" else None,
            cache=cache, stop_at_eos=False,
        )

    # Warm-up: one short block per mode (kernel selection, allocator, lazy init).
    for unmasking, cache in modes:
        diffusion_generate(model, prompts, generation_config=config(unmasking, cache, args.block_length))
    results = {}
    for _ in range(args.repeats):  # interleaved, so a slow phase of a shared machine hits every mode
        for unmasking, cache in modes:
            out, seconds, peak = timed_generate(model, prompts, config(unmasking, cache), args.device)
            best = results.get((unmasking, cache))
            if best is None or seconds < best[1]:
                results[(unmasking, cache)] = (out, seconds, peak)

    device_name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    config_ = model.config
    print(
        f"\n### Rollout: shape {args.shape} (d {config_.hidden_size}, {config_.num_hidden_layers} layers, vocab {vocab}), "
        f"{args.dtype}, {device_name}\n"
        f"gen {args.gen_length}, block {args.block_length}, batch {args.batch}, prompt {args.prompt_length}, "
        f"threshold {args.threshold}, static steps {args.steps}, logit std {args.logit_std}, "
        f"best of {args.repeats}\n"
    )
    print("| cache | unmasking | tokens/s | NFE | seconds | ms/step | × no cache | peak mem (GiB) | tokens/step | = no-cache tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    tokens = args.batch * args.gen_length
    for unmasking, cache in modes:
        out, seconds, peak = results[(unmasking, cache)]
        reference = results.get((unmasking, "none"))
        ratio = f"{reference[1] / seconds:.2f}" if reference else "–"
        agree = f"{(out.completion_ids == reference[0].completion_ids).float().mean().item():.0%}" if reference else "–"
        per_step = tokens / out.num_steps.sum().item()  # committed tokens per row-step
        print(
            f"| {cache} | {unmasking} | {tokens / seconds:.1f} | {out.nfe} | {seconds:.2f} | {1000 * seconds / out.nfe:.1f} | {ratio} | "
            f"{peak:.2f} | {per_step:.2f} | {agree} |"
        )


if __name__ == "__main__":
    main()
