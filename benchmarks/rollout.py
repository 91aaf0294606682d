"""Rollout throughput of the diffusion sampler: KV cache none / prefix / dual × static / dynamic unmasking.

Two ways to run it:

* one process (default): one Markdown table per batch size with tokens/s, forward passes (NFE), seconds,
  ms/step, speed-up over no cache for the same unmasking (measured in this same run), peak accelerator memory,
  tokens committed per row-step, KV-cache bytes written per step (counted from the cache layout) and how many
  tokens agree with the uncached decode (caches are an approximation with more than one layer);
* ``--compare-main``: this checkout against main before the in-place cache (``--baseline``, commit 898cab5),
  side by side in one run; every measurement in a fresh process (``before_after.py``), interleaved repeats,
  medians; plus peak resident memory, the KV-cache bytes per step of both cache layouts and the bytes that
  data-movement ops (copies, concatenations, gathers) write per step (counted at ``--count-batch``).
  ``--save FILE`` keeps every result as it arrives and a rerun reuses them (``--repeats`` counts them).

    python benchmarks/rollout.py                                    # CPU: small LLaDA-shaped model, batch 1 and 8
    python benchmarks/rollout.py --compare-main --batch 1 --save runs/rollout.jsonl   # before/after (CPU, 1 thread)
    python benchmarks/rollout.py --shape llada-8b --device cuda --batch 1,8,32 --logit-std 25

The default shape is LLaDA's layout at d 256 × 2 layers with the real vocabulary (126 464), prompt 128, gen
256, block 32, dynamic threshold 0.9, greedy (temperature 0). Random weights:

* a random model's logits are nearly uniform over the vocabulary, so the dynamic threshold never fires and
  dynamic unmasking commits one token per step (NFE = gen length, like static unmasking with ``steps =
  gen_length``): the setting the CPU targets are stated for. ``--logit-std S`` rescales the LM head (once,
  after building) so that the logits at masked positions have standard deviation S; confidences then spread
  over (0, 1) and several tokens clear the threshold per step (LLaDA-8B at 0.9 commits about 2–4 per step on
  GSM8K). The table reports the resulting tokens per step.
* ``stop_at_eos=False``: every row decodes all ``--gen-length`` positions.

Static unmasking uses ``--steps`` (default ``gen_length``: one token per step).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/tiny_models.py

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from before_after import BASELINE_COMMIT, Side, run_interleaved, worker_main

SHAPE_OVERRIDES = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4)
SHAPE_NAMES = ("small", "small-dream", "llada-8b", "dream-7b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPE_NAMES, default="small")
    parser.add_argument("--vocab", type=int, default=None, help="Override the shape's vocabulary size.")
    parser.add_argument("--layers", type=int, default=None, help="Override the shape's number of layers.")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--batch", default="1,8", help="Batch sizes, comma-separated (one table each).")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=None, help="Static unmasking steps (default gen_length).")
    parser.add_argument("--caches", default="none,prefix,dual")
    parser.add_argument("--unmasking", default="dynamic", help="'dynamic', 'static' or both, comma-separated.")
    parser.add_argument("--logit-std", type=float, default=None, help="Sharpen the random LM head (see above).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="Default: bfloat16 on GPU, float32 on CPU.")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the model.")
    parser.add_argument("--repeats", type=int, default=1, help="Timed runs per mode (interleaved; the median counts).")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 with --compare-main).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-main", action="store_true", help="Side by side with --baseline, fresh processes.")
    parser.add_argument("--baseline", default=BASELINE_COMMIT, help="Commit to compare against.")
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds per measurement process (--compare-main).")
    parser.add_argument("--count-batch", type=int, default=1, help="Batch size whose runs also count moved bytes.")
    parser.add_argument("--save", default=None, help="JSON-lines file of --compare-main results (reused, appended).")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.steps = args.steps or args.gen_length
    if args.compare_main and args.threads is None:
        args.threads = 1
    return args


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def model_shape(args) -> tuple[str, dict]:
    from tests.tiny_models import DREAM_7B_SHAPE, LLADA_8B_SHAPE

    family, shape = {
        "small": ("llada", dict(LLADA_8B_SHAPE, **SHAPE_OVERRIDES)),
        "small-dream": ("dream", dict(DREAM_7B_SHAPE, **dict(SHAPE_OVERRIDES, num_key_value_heads=2))),
        "llada-8b": ("llada", LLADA_8B_SHAPE),
        "dream-7b": ("dream", DREAM_7B_SHAPE),
    }[args.shape]
    shape = dict(shape)
    if args.vocab is not None:
        shape["vocab_size"] = args.vocab
        if shape["mask_token_id"] >= args.vocab:
            shape.update(mask_token_id=args.vocab - 1, eos_token_id=args.vocab - 2)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    return family, shape


def build_model(args):
    """The random model, created directly on ``args.device`` in ``args.dtype`` (8B never touches the CPU)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from dllm_trl.models import set_diffusion_properties
    from tests.tiny_models import tiny_dream_config, tiny_llada_config

    family, shape = model_shape(args)
    make_config, model_cls = (tiny_llada_config, LlamaForCausalLM) if family == "llada" else (tiny_dream_config, Qwen2ForCausalLM)
    config = make_config(**shape)
    config._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    with torch.device(args.device), default_dtype(DTYPES[args.dtype]):
        model = model_cls(config)
    model.eval().requires_grad_(False)
    return set_diffusion_properties(
        model, mask_token_id=shape["mask_token_id"], logit_shift=family == "dream",
        sampling="gumbel" if family == "llada" else "categorical",
    )


def make_prompts(args, model, batch: int) -> torch.Tensor:
    """Random prompt ids without special tokens (the same for every batch size's first rows)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    eos = model.config.eos_token_id
    special = {model.config.mask_token_id, *([eos] if isinstance(eos, int) else eos)}
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (batch, args.prompt_length), generator=generator)
    for token in special:
        prompts[prompts == token] = (token + 1) % vocab
    return prompts.to(args.device)


@torch.no_grad()
def sharpen(model, prompts, logit_std: float):
    """Rescale the LM head so the logits at masked positions have standard deviation ``logit_std``."""
    mask_id = model.config.mask_token_id
    canvas = torch.cat([prompts, torch.full((prompts.shape[0], 32), mask_id, device=prompts.device)], dim=1)
    logits = model(input_ids=canvas, logits_to_keep=32).logits.float()
    model.get_output_embeddings().weight.mul_(logit_std / logits.std().item())


def prepare(args):
    """The random model, sharpened if asked (from 8 prompts, whatever the batch)."""
    model = build_model(args)
    if args.logit_std:
        sharpen(model, make_prompts(args, model, 8), args.logit_std)
    return model


def generation_config(args, unmasking, cache, gen_length=None):
    from dllm_trl.generation import DiffusionGenerationConfig

    gen_length = gen_length or args.gen_length
    return DiffusionGenerationConfig(
        gen_length=gen_length, block_length=args.block_length, unmasking=unmasking, threshold=args.threshold,
        steps=(args.steps * gen_length // args.gen_length) if unmasking == "static" else None,
        cache=cache, stop_at_eos=False,
    )


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, prompts, cfg, device):
    from dllm_trl.generation import diffusion_generate

    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    out = diffusion_generate(model, prompts, generation_config=cfg)
    synchronize(device)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = torch.cuda.max_memory_allocated() / 2**30 if is_cuda else float("nan")
    return out, seconds, peak, cpu_seconds


def warm_up(model, prompts, args, modes):
    """One short block per mode: kernel selection, allocator, lazy init."""
    from dllm_trl.generation import diffusion_generate

    for unmasking, cache in modes:
        diffusion_generate(model, prompts, generation_config=generation_config(args, unmasking, cache, args.block_length))


class MovedBytes(TorchDispatchMode):
    """Counts the bytes that data-movement ops (copies, concatenations, gathers, scatters) write."""

    OPS = {"cat", "stack", "index_select", "gather", "index", "_unsafe_index", "embedding", "copy_", "clone",
           "_to_copy", "index_copy_", "slice_scatter", "repeat", "expand_copy"}
    SCATTERS = {"index_put_": 2, "scatter_": 2}  # in-place writes of a few elements: count those (values/index)

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in self.SCATTERS:
            self.bytes += args[self.SCATTERS[name]].numel() * args[0].element_size()
        elif name in self.OPS:
            written = kwargs.get("out", args[0] if name.endswith("_") else out)
            for tensor in written if isinstance(written, (tuple, list)) else [written]:
                if isinstance(tensor, torch.Tensor):
                    self.bytes += tensor.numel() * tensor.element_size()
        return out


def kv_bytes_per_step(args, config, batch: int, cache: str, nfe: int, layout: str) -> float:
    """KV-cache bytes written per decoding step, counted from the cache layout (reads are the same again).

    ``concat`` (main before issue 10): a ``DynamicCache`` holding the positions outside the window; each cached
    step concatenates the window onto it (a copy of kept + window positions) and slices it back, each refresh
    ``index_select``s the kept positions out of the full forward's cache. ``in_place`` (``CanvasCache``): a
    refresh keeps the forward's own tensors, a cached step writes the window's positions.
    """
    if cache == "none":
        return 0.0
    shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * head_dim * DTYPES[args.dtype].itemsize
    total = args.prompt_length + args.gen_length
    num_blocks = args.gen_length // args.block_length
    steps = nfe / num_blocks  # decoding steps per block (the first one refreshes)
    written = 0.0
    for block_index in range(num_blocks):
        start = args.prompt_length + block_index * args.block_length
        window = (args.block_length if cache == "dual" else total - start) + shift
        kept = total - window
        if layout == "concat":
            written += kept + (steps - 1) * (kept + window)
        else:
            written += (steps - 1) * window
    return written * per_position / nfe


def measure(spec: dict) -> dict:
    """One fresh-process measurement (``--compare-main`` worker): a warm-up block, one timed rollout and, with
    ``count_bytes``, one more under :class:`MovedBytes`."""
    args = SimpleNamespace(**spec["args"])
    if args.threads:
        torch.set_num_threads(args.threads)
    model = prepare(args)
    prompts = make_prompts(args, model, spec["batch"])
    mode = (spec["unmasking"], spec["cache"])
    warm_up(model, prompts, args, [mode])
    cfg = generation_config(args, *mode)
    out, seconds, peak, cpu_seconds = timed_generate(model, prompts, cfg, args.device)
    result = {"seconds": seconds, "cpu_seconds": cpu_seconds, "nfe": out.nfe, "gpu_peak_gib": peak,
              "completion_ids": out.completion_ids.tolist()}
    if spec.get("count_bytes"):  # after the timed run, so it changes neither the time nor the peak memory
        from dllm_trl.generation import diffusion_generate

        with MovedBytes() as moved:
            counted = diffusion_generate(model, prompts, generation_config=cfg)
        result["moved_bytes_per_step"] = moved.bytes / counted.nfe
    return result


def device_name(device) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"


def rollout_table(model, args, batch: int, modes, title: str = "Rollout"):
    """One table for ``batch``: header first, then each mode's row as soon as its last repeat is done (so a time
    limit keeps what was measured). Repeats are interleaved; the median counts; "× no cache" needs the
    ``none`` cache of the same unmasking earlier in ``modes``."""
    config = model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    print(
        f"\n### {title}: shape {args.shape} (d {config.hidden_size}, {config.num_hidden_layers} layers, vocab {vocab}), "
        f"{args.dtype}, {device_name(args.device)}\n"
        f"batch {batch}, prompt {args.prompt_length}, gen {args.gen_length}, block {args.block_length}, "
        f"threshold {args.threshold}, static steps {args.steps}, logit std {args.logit_std or 'raw'}, "
        f"median of {args.repeats}\n"
    )
    print("| cache | unmasking | tokens/s | NFE | seconds | ms/step | × no cache | peak mem (GiB) | tokens/step "
          "| KV MiB/step | = no-cache tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    prompts = make_prompts(args, model, batch)
    warm_up(model, prompts, args, modes)
    tokens = batch * args.gen_length
    runs = {mode: [] for mode in modes}
    for repeat in range(args.repeats):  # interleaved, so a slow phase of a shared machine hits every mode
        for unmasking, cache in modes:
            runs[(unmasking, cache)].append(timed_generate(model, prompts, generation_config(args, unmasking, cache), args.device))
            if repeat + 1 < args.repeats:
                continue
            out = runs[(unmasking, cache)][0][0]
            seconds = statistics.median(run[1] for run in runs[(unmasking, cache)])
            reference = runs.get((unmasking, "none"))
            ratio = agree = "–"
            if reference and len(reference) == args.repeats:
                ratio = f"{statistics.median(run[1] for run in reference) / seconds:.2f}"
                agree = f"{(out.completion_ids == reference[0][0].completion_ids).float().mean().item():.0%}"
            per_step = tokens / out.num_steps.sum().item()  # committed tokens per row-step
            kv = kv_bytes_per_step(args, config, batch, cache, out.nfe, "in_place") / 2**20
            peak = max(run[2] for run in runs[(unmasking, cache)])
            print(f"| {cache} | {unmasking} | {tokens / seconds:.1f} | {out.nfe} | {seconds:.2f} | {1000 * seconds / out.nfe:.1f} "
                  f"| {ratio} | {peak:.2f} | {per_step:.2f} | {kv:.1f} | {agree} |", flush=True)
    return {mode: statistics.median(run[1] for run in runs[mode]) for mode in modes}


def single_process(args):
    """Every mode in this process, one table per batch size."""
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [(u, c) for u in args.unmasking.split(",") for c in args.caches.split(",")]
    model = prepare(args)
    for batch in [int(b) for b in args.batch.split(",")]:
        rollout_table(model, args, batch, modes)


def compare_main(args):
    """This checkout vs ``args.baseline``, every measurement in a fresh process, interleaved, medians."""
    from tests.tiny_models import tiny_dream_config, tiny_llada_config

    sides = [Side.baseline(args.baseline), Side.current()]
    unmasking = args.unmasking.split(",")[0]
    caches = args.caches.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    plain = {k: v for k, v in vars(args).items()  # what a measurement depends on (so saved results match)
             if k not in ("compare_main", "baseline", "timeout", "save", "batch", "repeats", "count_batch")}
    specs = [dict(args=plain, batch=b, cache=c, unmasking=unmasking, count_bytes=b == args.count_batch)
             for b in batches for c in caches]
    load_before = os.getloadavg()
    timed = run_interleaved(__file__, specs, sides, args.repeats, args.timeout, save=args.save)
    load_after = os.getloadavg()
    family, shape = model_shape(args)
    config = (tiny_llada_config if family == "llada" else tiny_dream_config)(**shape)
    config.diffusion_logit_shift = family == "dream"

    def med(side, index, key):
        return statistics.median(r[key] for r in timed[(side, index)])

    print(
        f"\n### Rollout before/after: main ({args.baseline}) vs this checkout, fresh process per measurement\n"
        f"shape {args.shape} (d {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}), "
        f"{args.dtype}, CPU {args.threads} thread(s); prompt {args.prompt_length}, gen {args.gen_length}, block "
        f"{args.block_length}, {unmasking} {args.threshold if unmasking == 'dynamic' else args.steps}, greedy, logit "
        f"std {args.logit_std or 'raw'}; median of {args.repeats} interleaved repeats; load average "
        f"{load_before[0]:.1f} → {load_after[0]:.1f} (1 min), {load_before[2]:.1f} → {load_after[2]:.1f} (15 min)\n"
    )
    print("tokens/s and speed-ups from the worker's CPU time (one thread: robust to other processes on a shared "
          "machine); the wall-clock ratio is given beside it.\n")
    print("| batch | cache | NFE main / new | tokens/s main | tokens/s new | new / main | × none main | × none new "
          "| new / main (wall) | ms/step main / new | KV MiB/step main / new (layout) | moved MiB/step main / new "
          f"(measured at batch {args.count_batch}) | peak RSS MiB main / new | tokens = main |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for index, spec in enumerate(specs):
        batch, cache = spec["batch"], spec["cache"]
        none_index = specs.index(dict(spec, cache="none")) if "none" in caches else None
        tokens = batch * args.gen_length
        old, new = med("main", index, "cpu_seconds"), med("new", index, "cpu_seconds")
        wall = med("main", index, "seconds") / med("new", index, "seconds")
        nfe_old, nfe_new = timed[("main", index)][0]["nfe"], timed[("new", index)][0]["nfe"]
        speedups = ["–", "–"]
        if none_index is not None:
            speedups = [f"{med(side, none_index, 'cpu_seconds') / med(side, index, 'cpu_seconds'):.2f}"
                        for side in ("main", "new")]
        kv = [kv_bytes_per_step(args, config, batch, cache, n, layout) / 2**20
              for n, layout in ((nfe_old, "concat"), (nfe_new, "in_place"))]
        moved = "–"
        if spec["count_bytes"]:
            moved = " / ".join(f"{timed[(side, index)][0]['moved_bytes_per_step'] / 2**20:.2f}" for side in ("main", "new"))
        rss = " / ".join(f"{med(side, index, 'peak_rss_mib'):.0f}" for side in ("main", "new"))
        same = (torch.tensor(timed[("main", index)][0]["completion_ids"])
                == torch.tensor(timed[("new", index)][0]["completion_ids"]))
        print(f"| {batch} | {cache} | {nfe_old} / {nfe_new} | {tokens / old:.1f} | {tokens / new:.1f} | {old / new:.2f} "
              f"| {speedups[0]} | {speedups[1]} | {wall:.2f} | {1000 * old / nfe_old:.0f} / {1000 * new / nfe_new:.0f} "
              f"| {kv[0]:.2f} / {kv[1]:.2f} | {moved} | {rss} | {same.float().mean().item():.1%} |")


def main(argv=None):
    args = parse_args(argv)
    if args.compare_main:
        compare_main(args)
    else:
        single_process(args)


if __name__ == "__main__":
    if not worker_main(measure):
        main()
