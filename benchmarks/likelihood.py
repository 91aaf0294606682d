"""The likelihood evaluation's ELBO estimators (``dllm_trl.losses.elbo``) on the addition toy: their error and their
cost.

1. Error: on one request (``"48+87="`` → ``"135"`` + 2 EOS, 5 tokens; the toy block model: ``"48+8"`` → ``"7=135"`` +
   EOS, two blocks) the standard deviation of the estimate over ``--seeds`` seeds against the number of samples
   ``mc_num`` (one mask batch of ``mc_num`` rows), stratified rows (the library's) and independent rows ("plain"),
   for LLaDA's and Dream's estimators; ``std · √n`` stays flat when the error falls as 1/√n. The exact ELBO (every
   mask enumerated) is printed beside the means.
2. Cost: requests per second of the four-way multiple-choice task (``tests/data/lm_eval/toy_addition_choice.yaml``'s
   documents: 4 requests each) scored by :class:`~dllm_trl.evaluation.lm_eval.DiffusionLM` against ``mc_num``, and
   the task's accuracy on the scored documents.

    python benchmarks/likelihood.py                 # 400 seeds, 40 documents
    python benchmarks/likelihood.py --seeds 100 --documents 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "data" / "lm_eval"))

from dllm_trl.losses.elbo import sequence_elbo  # noqa: E402
from dllm_trl.toy import load_toy  # noqa: E402
from dllm_trl.toy.block import load_toy_block  # noqa: E402
from tests.test_elbo import exact_elbo  # noqa: E402  (the enumeration oracle)


def error_table(seeds: int, sample_counts: list[int]) -> None:
    for name, load, prompt_text, continuation_text, eos in (
        ("toy (LLaDA layout)", load_toy, "48+87=", "135", 2), ("toy block (SDAR layout, blocks of 4)",
                                                               load_toy_block, "48+8", "7=135", 1)):
        model, tokenizer = load()
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        prompt, continuation = ids(prompt_text), ids(continuation_text) + [tokenizer.eos_token_id] * eos
        exact = exact_elbo(model, prompt, continuation)
        print(f"\n### {name}: {prompt_text!r} -> {continuation_text!r} + {eos} EOS; exact ELBO {exact:.4f} nats\n")
        print("| estimator | rows | mc_num | mean | std | std·√n | bias / (std/√seeds) |")
        print("|---|---|---|---|---|---|---|")
        for estimator in ("llada", "dream"):
            for stratified in (True, False):
                for n in sample_counts:
                    values = torch.tensor([
                        sequence_elbo(model, torch.tensor(prompt), torch.tensor(continuation), estimator, n, n,
                                      torch.Generator().manual_seed(seed), stratified=stratified).value
                        for seed in range(seeds)], dtype=torch.float64)
                    std = values.std().item()
                    z = (values.mean().item() - exact) / (std / seeds**0.5)
                    print(f"| {estimator} | {'stratified' if stratified else 'plain'} | {n} | "
                          f"{values.mean().item():.4f} | {std:.4f} | {std * n**0.5:.3f} | {z:+.2f} |")


def cost_table(documents: int, sample_counts: list[int]) -> None:
    from lm_eval.api.instance import Instance

    from dllm_trl.evaluation.lm_eval import DiffusionLM
    from toy_addition_choice import load_dataset

    data = load_dataset()["test"].select(range(documents))
    print(f"\n### 4-choice toy task, {documents} documents ({4 * documents} requests), CPU, "
          f"{torch.get_num_threads()} threads\n")
    print("| estimator | mc_num | mc_batch_size | requests/s | accuracy |")
    print("|---|---|---|---|---|")
    for estimator, counts in (("llada", sample_counts), ("left_to_right", [None])):
        for n in counts:
            batch = 1 if n is None else min(n, 32)
            lm = DiffusionLM(estimator=estimator, mc_num=n or 1, mc_batch_size=batch)
            requests = [Instance("loglikelihood", {}, (d["prompt"], c), 0) for d in data for c in d["choices"]]
            start = time.perf_counter()
            scores = [value for value, _ in lm.loglikelihood(requests)]
            seconds = time.perf_counter() - start
            correct = sum(max(range(4), key=lambda j: scores[4 * i + j]) == d["label"] for i, d in enumerate(data))
            print(f"| {estimator} | {n or '-'} | {batch if n else '-'} | {len(requests) / seconds:.1f} | "
                  f"{correct / documents:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=400)
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--mc-nums", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--cost-mc-nums", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args()
    torch.set_num_threads(1)
    error_table(args.seeds, args.mc_nums)
    cost_table(args.documents, args.cost_mc_nums)


if __name__ == "__main__":
    main()
