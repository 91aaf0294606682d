"""Cost of the divergence trust-region mask against the plain GRPO clipped loss, side by side (SPEC §3).

Random logits at LLaDA's vocabulary (V = 126464) and a behaviour top-K of K = 20; per method, the median time
of loss forward + backward down to the logits, and on a GPU the peak memory above the inputs:

* GRPO clipped loss: log π(a) = logits[a] − logsumexp(logits), ratio to π_old, PPO clip (TRL's default path);
* DPPO predictive mask: the same logsumexp, a gather at S = topK(μ) ∪ {a}, the truncated view, top-K KL,
  the uniform-tail directional derivative, the mask and the truncated-IS policy gradient (DPPOMaskTrainer);
* DPPO ratio mask (the paper's baseline) and the mask math alone (no grad, from the gathered support);
* the generation-side capture (BehaviourCapture: log-softmax + top-K per decoding step) against the sampling
  step it rides on (softmax + multinomial), per step for B rows.

    python benchmarks/dppo_mask_cost.py                              # CPU: 2 x 128 tokens, float32
    python benchmarks/dppo_mask_cost.py --device cuda --batch 8 --length 1024   # bf16 logits
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dllm_trl.losses.divergence_masks import (
    gather_policy_view,
    kl_direction,
    masked_policy_gradient_terms,
    trust_region_mask,
    topk_kl,
    truncated_view,
)
from dllm_trl.models.scoring import selective_log_softmax
from dllm_trl.trainers import BehaviourCapture


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="B (default 2 on CPU, 8 on GPU).")
    parser.add_argument("--length", type=int, default=None, help="C tokens per row (default 128 on CPU, 1024 on GPU).")
    parser.add_argument("--vocab", type=int, default=126464)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="Logits dtype (GPU: bfloat16).")
    parser.add_argument("--repeats", type=int, default=None, help="Timed repeats (default 5 on CPU, 20 on GPU).")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_inputs(args, device, dtype):
    """Logits of π_θ, a nearby behaviour μ (its top-K and the sampled action) and advantages."""
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    n, v, k = args.batch * args.length, args.vocab, args.top_k
    base = torch.randn(n, v, generator=g) * 2.0
    mu_logps = torch.log_softmax(base + 0.3 * torch.randn(n, v, generator=g), dim=-1)
    action = torch.multinomial(mu_logps.exp(), 1, generator=g).squeeze(-1)
    mu_topk, mu_ids = mu_logps.topk(k, dim=-1)
    mu_action = mu_logps.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    advantages = torch.randn(n, generator=g)
    del mu_logps
    to = dict(device=device)
    return {
        "logits": base.to(device=device, dtype=dtype).view(args.batch, args.length, v),
        "action": action.to(**to).view(args.batch, args.length),
        "mu_ids": mu_ids.to(**to).view(args.batch, args.length, k),
        "mu_topk": mu_topk.to(**to).view(args.batch, args.length, k),
        "mu_action": mu_action.to(**to).view(args.batch, args.length),
        "advantages": advantages.to(**to).view(args.batch, args.length),
    }


def grpo_loss(x, logits):
    logps = selective_log_softmax(logits, x["action"])
    ratio = torch.exp(logps - x["mu_action"])
    adv = x["advantages"]
    return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()


def dppo_loss(x, logits, rule="predictive"):
    scaled = logits.float()
    lse = torch.logsumexp(scaled, dim=-1)
    pi_support = gather_policy_view(scaled, x["mu_ids"], x["action"]) - lse.unsqueeze(-1)
    keep = mask_only(x, pi_support.detach(), logits.shape[-1], rule)
    terms, _ = masked_policy_gradient_terms(pi_support[..., -1], x["mu_action"], x["advantages"], keep, 20.0)
    return terms.mean()


def mask_only(x, pi_support, vocab_size, rule="predictive"):
    view = truncated_view(x["mu_ids"], x["mu_topk"], x["action"], x["mu_action"], pi_support, vocab_size=vocab_size)
    div = topk_kl(view)
    direction = kl_direction(view, "uniform")
    log_ratio = pi_support[..., -1] - x["mu_action"]
    return trust_region_mask(rule, advantages=x["advantages"], log_ratio=log_ratio, div=div, direction=direction,
                             delta=0.15)


def measure(fns, device, repeats, warmup=2):
    """Median seconds of each ``fn()`` (rounds interleaved, so that load on a shared machine hits all alike) and,
    on a GPU, its peak memory in bytes above what was allocated before it ran."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        for _ in range(warmup):
            fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            bucket.append(time.perf_counter() - start)
    peaks = [None] * len(fns)
    if device.type == "cuda":
        for i, fn in enumerate(fns):
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            fn()
            sync()
            peaks[i] = torch.cuda.max_memory_allocated(device) - before
    return [statistics.median(t) for t in times], peaks


def main():
    args = parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.batch = args.batch or (8 if gpu else 2)
    args.length = args.length or (1024 if gpu else 128)
    repeats = args.repeats or (20 if gpu else 5)
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    torch.manual_seed(args.seed)
    x = make_inputs(args, device, dtype)
    leaf = x["logits"].detach().requires_grad_(True)

    def backward(loss_fn):
        def run():
            leaf.grad = None
            loss_fn(x, leaf).backward()
        return run

    support = gather_policy_view(leaf.detach().float(), x["mu_ids"], x["action"]) - torch.logsumexp(
        leaf.detach().float(), dim=-1, keepdim=True)
    rows = torch.randn(args.batch, args.vocab, device=device, dtype=torch.float32)
    capture = BehaviourCapture(args.top_k)
    tokens = torch.zeros(args.batch, 1, dtype=torch.long, device=device)

    def capture_step():
        capture(tokens, rows)
        if capture.num_steps > 64:
            capture.reset()

    def sampling_step():
        torch.multinomial(torch.softmax(rows, dim=-1), 1)

    loss_rows = [
        ("GRPO clipped loss (fwd+bwd)", backward(grpo_loss)),
        ("DPPO predictive mask (fwd+bwd)", backward(dppo_loss)),
        ("DPPO ratio mask (fwd+bwd)", backward(lambda inputs, logits: dppo_loss(inputs, logits, "dppo"))),
        ("  mask math only (no grad)", lambda: mask_only(x, support, args.vocab)),
    ]
    gen_rows = [
        (f"sampling step, {args.batch} rows (softmax+draw)", sampling_step),
        (f"  + BehaviourCapture (log-softmax+top-{args.top_k})", capture_step),
    ]
    print(f"V={args.vocab} K={args.top_k} tokens={args.batch * args.length} ({args.batch}x{args.length}) "
          f"device={device} logits={str(dtype).replace('torch.', '')} repeats={repeats}")
    header = f"{'':52s}{'ms':>10s}{'x GRPO':>9s}" + (f"{'peak MiB':>11s}{'x GRPO':>9s}" if gpu else "")
    for title, rows_, ref_name in (("loss", loss_rows, "GRPO"), ("generation", gen_rows, "sampling")):
        print(f"\n[{title}]")
        print(header.replace("x GRPO", f"x {ref_name[:5]}"))
        results = measure([fn for _, fn in rows_], device, repeats)
        for (name, _), seconds, peak in zip(rows_, *results):
            line = f"{name:52s}{seconds * 1e3:10.2f}{seconds / results[0][0]:9.2f}"
            if gpu:
                line += f"{peak / 2**20:11.1f}{peak / max(results[1][0], 1):9.2f}"
            print(line)

if __name__ == "__main__":
    main()
