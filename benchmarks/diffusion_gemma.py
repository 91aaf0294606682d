"""DiffusionGemma (SPEC §8): our recording rollout against transformers' ``model.generate``, and the RLDF update.

Two tables:

* rollout: tokens/s of ``DiffusionGemmaSampler`` (which also records every step) and of ``model.generate`` on the
  same random weights and random state, forwards, and the share of tokens equal between the two (100%: the sampler
  reproduces ``generate``);
* RLDF update (``DiffusionGemmaRLDFLoss``, REINFORCE, c = 0.2): the no-grad π_old pass that fixes the clean targets and
  the loss forward + backward over the k sampled steps of each row (one replay of the encoder chunks, one decoder call
  per canvas with states), seconds and peak memory;

and the size of the per-step self-conditioning record at the 26B-A4B shape for both carriers.

CPU default: hidden 256, 2 layers (sliding + full), 8 experts top-2, vocabulary 8192, canvas 32, 16 denoising steps,
prompt 32, gen 64, batch 4; the LM head sharpened (final norm ×``--sharpen``) so that the entropy bound accepts
several positions per step::

    python benchmarks/diffusion_gemma.py
    python benchmarks/diffusion_gemma.py --shape 26b-a4b --device cuda --dtype bfloat16 --trainable attention
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py

import torch

from dllm_trl import RLDFConfig
from dllm_trl.generation import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig
from dllm_trl.losses import DiffusionGemmaRLDFLoss
from tests.tiny_models import DIFFUSION_GEMMA_26B_A4B_SHAPE, build_tiny_diffusion_gemma
from device_memory import peak_gib, sync

SMALL = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, sliding_window=64, num_experts=8, top_k_experts=2,
             moe_intermediate_size=128, canvas_length=32)
SHAPES = {"small": SMALL, "26b-a4b": DIFFUSION_GEMMA_26B_A4B_SHAPE}


def record_bytes(hidden: int, vocab: int, batch: int = 8, length: int = 256, steps: int = 16, item: int = 2) -> dict:
    """Bytes of the self-conditioning record of ``steps`` steps for both carriers (``item`` bytes per value)."""
    return {"embedding": batch * length * hidden * steps * item, "logits": batch * length * vocab * steps * item}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="Denoising steps per canvas.")
    parser.add_argument("--k", type=int, default=4, help="Sampled steps per row in the update.")
    parser.add_argument("--sharpen", type=float, default=25.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trainable", choices=("all", "attention"), default="all")
    return parser.parse_args(argv)


def build_model(args):
    """The random model, built directly on the device in its dtype (the 26B-A4B shape never touches the CPU); with
    ``--trainable attention`` only the attention projections take gradients (LoRA-sized optimizer state)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            model = build_tiny_diffusion_gemma(**SHAPES[args.shape])
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        model.model.decoder.norm.weight.mul_(args.sharpen)
    if args.trainable == "attention":
        for name, param in model.named_parameters():
            param.requires_grad_("self_attn" in name and name.endswith("proj.weight"))
    return model


@contextlib.contextmanager
def timed(device, into: dict):
    """Seconds and peak device memory (GiB, NaN on CPU) of the block, into ``into``."""
    with peak_gib(device, into):
        start = time.perf_counter()
        yield
        sync(device)
        into["seconds"] = time.perf_counter() - start


def rollout_table(model, args):
    config = model.config
    sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=args.gen_length, max_denoising_steps=args.steps,
                                                                eos_token_id=config.text_config.vocab_size - 4))
    prompts = torch.randint(3, config.text_config.vocab_size - 4, (args.batch, args.prompt_length),
                            generator=torch.Generator().manual_seed(0)).to(args.device)
    ours, theirs = {}, {}
    torch.manual_seed(1)
    with timed(args.device, ours):
        output = sampler(model, prompts)
    torch.manual_seed(1)
    with timed(args.device, theirs):
        reference = model.generate(prompts, max_new_tokens=args.gen_length, max_denoising_steps=args.steps,
                                   eos_token_id=config.text_config.vocab_size - 4, pad_token_id=0).sequences
    width = reference.shape[1]
    same = (output.sequences[:, :width] == reference).float().mean().item()
    tokens = args.batch * args.gen_length
    print("| rollout | tokens/s | seconds | forwards | peak GiB | = generate tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| DiffusionGemmaSampler (records) | {tokens / ours['seconds']:.1f} | {ours['seconds']:.2f} | {output.nfe} | "
          f"{ours['peak']:.2f} | {same:.0%} |")
    print(f"| model.generate | {tokens / theirs['seconds']:.1f} | {theirs['seconds']:.2f} | {output.nfe} | "
          f"{theirs['peak']:.2f} | |")
    accepted = output.denoising_steps.accept_mask & output.denoising_steps.active.unsqueeze(-1)
    print(f"\naccepted per step: {accepted.sum(-1).float()[output.denoising_steps.active].mean().item():.1f} of "
          f"{config.canvas_length}; record of the rollout: self-conditioning "
          f"{output.denoising_steps.self_conditioning.numel() * output.denoising_steps.self_conditioning.element_size() / 2**20:.1f} MiB\n")
    return prompts, output


def update_table(model, args, prompts, output):
    rldf = RLDFConfig("/tmp/diffusion-gemma-bench", max_completion_length=args.gen_length,
                      block_length=model.config.canvas_length, num_sampled_timesteps=args.k, beta=0.0,
                      use_cpu=args.device == "cpu", report_to="none", save_strategy="no")
    loss = DiffusionGemmaRLDFLoss(rldf)
    trajectory, _ = loss.sample_states(prompts, torch.ones_like(prompts), output, torch.Generator().manual_seed(2), None)
    batch = dict(trajectory, advantages=torch.linspace(-1, 1, prompts.shape[0], device=prompts.device))
    old, update = {}, {}
    with timed(args.device, old), torch.no_grad():
        old_logps = loss.score_states(model, batch)
    batch["target_mask"] = loss.target_mask(batch, old_logps, None)
    batch["num_target_tokens"] = batch["target_mask"].sum()
    call = loss.begin(batch, loss.normalizer(batch, 1, 1.0), 0.0, 0.2, 0.2)
    steps = (batch["sampled_steps"] >= 0).any(0).nonzero().squeeze(1).tolist()
    with timed(args.device, update):
        value = sum(loss.chunk_loss(model, batch, chunk, call) for chunk in loss.loss_chunks(model, batch, steps))
        value.backward()
    print("| RLDF update | k | rows | π_old pass s | loss fwd+bwd s | peak GiB | targets/state | loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    per_state = batch["target_mask"].sum().item() / max((batch["sampled_steps"] >= 0).sum().item(), 1)
    print(f"| replay (encoder chunks once, decoder per canvas) | {args.k} | {prompts.shape[0]} | {old['seconds']:.2f} | "
          f"{update['seconds']:.2f} | {update['peak']:.2f} | {per_state:.1f} | {value.item():.4f} |\n")


def print_record_sizes():
    shape = DIFFUSION_GEMMA_26B_A4B_SHAPE
    sizes = record_bytes(shape["hidden_size"], shape["vocab_size"])
    print("Self-conditioning record at the 26B-A4B shape (batch 8 × 256 positions × 16 steps, bf16): "
          f"embedding {sizes['embedding'] / 1e6:.1f} MB, logits {sizes['logits'] / 1e9:.2f} GB "
          f"({sizes['logits'] / 16 / 1e9:.2f} GB per step)\n")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    print_record_sizes()
    prompts, output = rollout_table(model, args)
    update_table(model, args, prompts, output)


if __name__ == "__main__":
    main()
