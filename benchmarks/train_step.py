"""Cost of one RLDF update against the rollout and against the exact loss over every trajectory step.

One table per run (seconds and peak memory side by side, ratios to the rollout of the same batch):

* rollout: block-wise dynamic decoding with dual cache, trajectory recorded;
* RLDF k=4 and k=16: weighted timestep sampling, one forward + backward per sampled step (what
  ``RLDFTrainer`` does), plus the no-grad π_old pass that fixes the clean targets;
* k=16, one backward: the same loss kept in one graph — what per-step backward saves in memory;
* full trajectory: the exact sequential loss over every decoding step.

CPU default: a small LLaDA-shaped model. ``--shape llada-8b`` builds an 8B-shaped model with random
weights in bf16 directly on the GPU and trains LoRA adapters (gen 256, 8 prompts x 4 generations)::

    python benchmarks/train_step.py
    python benchmarks/train_step.py --shape llada-8b --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py

import torch

from dllm_trl import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.losses import clean_target_mask, noisy_state, policy_token_terms, sample_timesteps, step_uncertainty
from dllm_trl.models import completion_token_logps, set_diffusion_properties
from tests.tiny_models import LLADA_8B_SHAPE, build_tiny_llada


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["small", "llada-8b"], default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gen-length", type=int, default=None)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--generations", type=int, default=None)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=None, help="Vocabulary of the small shape.")
    parser.add_argument("--sharpen", type=float, default=8.0, help="Scale of the LM head so confidences exceed 0.9.")
    parser.add_argument("--skip-full", action="store_true", help="Skip the full-trajectory loss (slow).")
    return parser.parse_args()


def build_model(args):
    if args.shape == "small":
        model = build_tiny_llada(
            vocab_size=args.vocab or 32000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
            num_attention_heads=4, eos_token_id=1,
        ).to(args.device)
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        from tests.tiny_models import tiny_llada_config

        shape = dict(LLADA_8B_SHAPE)
        mask_id, eos = shape.pop("mask_token_id"), shape.pop("eos_token_id")
        config = tiny_llada_config(eos_token_id=eos, **shape)
        config._attn_implementation = "sdpa"
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
        set_diffusion_properties(model, mask_token_id=mask_id)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    with torch.no_grad():  # sharpen the random head so that dynamic unmasking commits several tokens per step
        model.get_output_embeddings().weight.mul_(args.sharpen)
    return model


class PeakMemory:
    """Peak device memory (CUDA) or peak resident set size (CPU, sampled) inside the block, in MiB."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            import psutil

            self._process = psutil.Process()
            self._base = self._process.memory_info().rss
            self._stop = threading.Event()
            self._peak_rss = self._base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._peak_rss = max(self._peak_rss, self._process.memory_info().rss)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak = (self._peak_rss - self._base) / 2**20
        return False


def rldf_update(model, batch, sampled, advantages, mask_id, per_step_backward=True, threshold=0.2):
    """One RLDF update's forward/backward work over the sampled steps (REINFORCE, token normalisation)."""
    prompt, prompt_mask, rollout, commit, valid = batch
    steps = [j for j in range(sampled.shape[1]) if bool((sampled[:, j] >= 0).any())]
    with torch.no_grad():  # π_old pass that fixes the clean targets before the loss
        targets = []
        for j in steps:
            rows = (sampled[:, j] >= 0).nonzero().squeeze(1)
            t = sampled[rows, j]
            logps = completion_token_logps(model, prompt[rows], prompt_mask[rows],
                                           noisy_state(rollout[rows], commit[rows], t, mask_id), rollout[rows])
            targets.append((rows, t, clean_target_mask(commit[rows], valid[rows], t, logps.exp(), threshold)))
    count = sum(int(m.sum()) for _, _, m in targets) or 1
    graph = []
    for rows, t, target in targets:
        logps = completion_token_logps(model, prompt[rows], prompt_mask[rows],
                                       noisy_state(rollout[rows], commit[rows], t, mask_id), rollout[rows])
        terms, _ = policy_token_terms(logps, advantages[rows])
        loss = (terms * target).sum() / count
        if per_step_backward:
            loss.backward()
        else:
            graph.append(loss)
    if graph:
        torch.stack(graph).sum().backward()
    model.zero_grad(set_to_none=True)


def main():
    args = parse_args()
    torch.manual_seed(0)
    big = args.shape != "small"
    gen = args.gen_length or (256 if big else 128)
    prompts = args.prompts or (8 if big else 2)
    generations = args.generations or (4 if big else 2)
    model = build_model(args)
    mask_id = model.config.mask_token_id
    batch_size = prompts * generations
    vocab = model.config.vocab_size
    prompt = torch.randint(2, vocab - 2, (prompts, args.prompt_length), device=args.device).repeat_interleave(generations, 0)
    prompt_mask = torch.ones_like(prompt)
    config = DiffusionGenerationConfig(gen_length=gen, block_length=args.block_length, cache="dual", temperature=1.0,
                                       stop_at_eos=False, seed=0)
    rows = []

    def timed(name, fn):
        sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
        with PeakMemory(args.device) as memory:
            sync()
            start = time.perf_counter()
            result = fn()
            sync()
            seconds = time.perf_counter() - start
        rows.append((name, seconds, memory.peak))
        return result

    model.eval()
    out = timed("rollout (dynamic, dual cache)", lambda: diffusion_generate(model, prompt, prompt_mask, config))
    steps_total = int(out.num_steps.max())
    uncertainty, has = step_uncertainty(out.commit_step, out.commit_prob, out.completion_mask, steps_total)
    advantages = torch.randn(batch_size, device=args.device)
    batch = (prompt, prompt_mask, out.completion_ids, out.commit_step, out.completion_mask)
    generator = torch.Generator(device=args.device).manual_seed(0)
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if big else contextlib.nullcontext()
    with autocast:
        for k in (4, 16):
            sampled = sample_timesteps(uncertainty, has, k, 1.0, generator)
            timed(f"RLDF update k={k}", lambda: rldf_update(model, batch, sampled, advantages, mask_id))
        sampled = sample_timesteps(uncertainty, has, 16, 1.0, generator)
        timed("k=16, one backward", lambda: rldf_update(model, batch, sampled, advantages, mask_id, per_step_backward=False))
        if not args.skip_full:
            every = torch.where(has, torch.arange(steps_total, device=args.device), -1)
            timed(f"full trajectory ({steps_total} steps)", lambda: rldf_update(model, batch, every, advantages, mask_id))

    rollout_seconds = rows[0][1]
    unit = "GPU peak MiB" if torch.device(args.device).type == "cuda" else "peak RSS growth MiB"
    print(f"\nshape={args.shape} device={args.device} batch={batch_size} gen={gen} block={args.block_length} "
          f"vocab={vocab} decoding steps={steps_total} (mean {out.num_steps.float().mean():.0f}/row), nfe={out.nfe}\n")
    print(f"| phase | seconds | x rollout | {unit} |")
    print("|---|---:|---:|---:|")
    for name, seconds, peak in rows:
        print(f"| {name} | {seconds:.2f} | {seconds / rollout_seconds:.2f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
