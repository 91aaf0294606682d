"""The cost of DiffusionGemma's gradient through the self-conditioning chain: ``DiffusionGemmaRLDFLoss(args,
self_conditioning_gradient="chain")`` against the default ``"recorded"``, on the same rollout and the same sampled
steps, side by side in one run.

Per option: the no-grad π_old pass (which fixes the clean targets), the loss forward and its backward over the ``k``
sampled steps of each row (median seconds over ``--repeats``, the two options alternating; on CPU the process's CPU
seconds, which other jobs on a shared machine disturb less than the wall clock), the decoder calls per loss
forward (the chain adds one per earlier step of each sampled step's canvas, shared by a row's sampled steps), and the
memory of the forward: on CUDA its peak allocated GiB, everywhere the bytes autograd saves for the backward (the
activations the forward must keep), counted once per storage. The model: the random DiffusionGemma of
``benchmarks/diffusion_gemma.py`` (hidden 256, 2 layers, 8 experts top-2, vocabulary 8192, canvas 32, 16 steps per
canvas, prompt 32, gen 64, batch 4, the final norm sharpened so that several positions are accepted per step)::

    OMP_NUM_THREADS=1 python benchmarks/diffusion_gemma_sc_chain_cost.py
    OMP_NUM_THREADS=1 python benchmarks/diffusion_gemma_sc_chain_cost.py --stability-threshold 16  # all 16 steps
    python benchmarks/diffusion_gemma_sc_chain_cost.py --device cuda --json chain_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dllm_trl import RLDFConfig
from dllm_trl.generation import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig
from dllm_trl.losses import DiffusionGemmaRLDFLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py
from tests.tiny_models import build_tiny_diffusion_gemma  # noqa: E402

SMALL = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, sliding_window=64, num_experts=8, top_k_experts=2,
             moe_intermediate_size=128, canvas_length=32)
OPTIONS = ("recorded", "chain")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="Denoising steps per canvas.")
    parser.add_argument("--k", type=int, default=4, help="Sampled steps per row.")
    parser.add_argument("--sharpen", type=float, default=25.0)
    parser.add_argument("--stability-threshold", type=int, default=1,
                        help="The sampler's: unchanged argmax steps before a row may stop early (--steps: never).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="Also write the measurements here.")
    return parser.parse_args(argv)


class SavedBytes:
    """Bytes autograd saves for the backward inside the block (each storage once)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def clock(device) -> float:
    """Wall seconds on an accelerator, the process's CPU seconds on CPU (one thread: the work done)."""
    return time.perf_counter() if str(device).startswith("cuda") else time.process_time()


def measure(model, loss, trajectory, device) -> dict:
    """One π_old pass, loss forward and backward of ``loss`` on ``trajectory``: seconds, decoder calls, memory."""
    calls = []
    handle = model.model.decoder.register_forward_hook(lambda *_: calls.append(1))
    batch = dict(trajectory, advantages=torch.linspace(-1.0, 1.0, trajectory["sampled_steps"].shape[0], device=device))
    try:
        sync(device)
        start = clock(device)
        with torch.no_grad():
            old = loss.score_states(model, batch)
        sync(device)
        old_seconds = clock(device) - start
        batch["target_mask"] = loss.target_mask(batch, old, None)
        call = loss.begin(batch, loss.normalizer(batch, 1, 1.0), 0.0, 0.2, 0.2)
        steps = (batch["sampled_steps"] >= 0).any(0).nonzero().squeeze(1).tolist()
        model.zero_grad()
        calls.clear()
        if str(device).startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = clock(device)
        with SavedBytes() as saved:
            value = sum(loss.chunk_loss(model, batch, chunk, call) for chunk in loss.loss_chunks(model, batch, steps))
        sync(device)
        forward_seconds = clock(device) - start
        peak = ((torch.cuda.max_memory_allocated(device) - base) / 2**30 if str(device).startswith("cuda")
                else float("nan"))
        decoder_calls = len(calls)
        start = clock(device)
        value.backward()
        sync(device)
        backward_seconds = clock(device) - start
    finally:
        handle.remove()
    return dict(old_pass_seconds=old_seconds, forward_seconds=forward_seconds, backward_seconds=backward_seconds,
                decoder_calls=decoder_calls, saved_mib=saved.total / 2**20, forward_peak_gib=peak, loss=value.item())


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.device(args.device):
        model = build_tiny_diffusion_gemma(**SMALL)
    with torch.no_grad():
        model.model.decoder.norm.weight.mul_(args.sharpen)
    vocab = model.config.text_config.vocab_size
    sampler = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=args.gen_length,
                                                                max_denoising_steps=args.steps, eos_token_id=vocab - 4,
                                                                stability_threshold=args.stability_threshold))
    prompts = torch.randint(3, vocab - 4, (args.batch, args.prompt_length),
                            generator=torch.Generator().manual_seed(0)).to(args.device)
    torch.manual_seed(1)
    output = sampler(model, prompts)
    config = RLDFConfig("/tmp/dllm-trl-sc-chain-cost", max_completion_length=args.gen_length,
                        block_length=SMALL["canvas_length"], num_sampled_timesteps=args.k, use_cpu=args.device == "cpu",
                        report_to="none", save_strategy="no", beta=0.0, loss_normalization="sample")
    losses = {option: DiffusionGemmaRLDFLoss(config, self_conditioning_gradient=option) for option in OPTIONS}
    mask = torch.ones_like(prompts)
    trajectories = {option: loss.sample_states(prompts, mask, output, torch.Generator().manual_seed(3), None)[0]
                    for option, loss in losses.items()}
    sampled = trajectories["recorded"]["sampled_steps"]
    assert torch.equal(sampled, trajectories["chain"]["sampled_steps"])
    record = output.denoising_steps
    first = {int(c): int((record.canvas == c).nonzero()[0]) for c in record.canvas.unique()}
    live = sampled[sampled >= 0]
    depth = [int(s) - first[int(record.canvas[s])] for s in live]
    runs = {option: [] for option in OPTIONS}
    for _ in range(args.repeats):
        for option in OPTIONS:
            runs[option].append(measure(model, losses[option], trajectories[option], args.device))
    result = dict(setup=dict(vars(args), shape=SMALL, recorded_steps=int(record.canvas.numel()),
                             sampled_states=int(live.numel()), mean_chain_depth=statistics.fmean(depth)),
                  runs=runs)
    median = {option: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
              for option, rows in runs.items()}
    result["median"] = median
    print(f"{args.batch} rows, {result['setup']['recorded_steps']} recorded steps, {live.numel()} sampled states, "
          f"mean steps before a sampled one in its canvas {result['setup']['mean_chain_depth']:.1f}; median of "
          f"{args.repeats} on {args.device} ({'CPU' if args.device == 'cpu' else 'wall'} seconds), "
          f"{args.threads} thread(s)\n")
    keys = [("old_pass_seconds", "π_old pass s"), ("forward_seconds", "loss forward s"),
            ("backward_seconds", "backward s"), ("decoder_calls", "decoder calls / forward"),
            ("saved_mib", "saved for backward MiB"), ("forward_peak_gib", "forward peak GiB (CUDA)")]
    print("| quantity | recorded | chain | chain / recorded |")
    print("|---|---:|---:|---:|")
    for key, label in keys:
        a, b = median["recorded"][key], median["chain"][key]
        print(f"| {label} | {a:.3g} | {b:.3g} | {b / a if a else float('nan'):.2f}× |")
    print(f"\nloss at π_old: recorded {median['recorded']['loss']:.6f}, chain {median['chain']['loss']:.6f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
