"""Greedy accuracy and decoding speed of the toy models (diffusion and causal) on the toy tasks."""

from __future__ import annotations

import argparse

from ..evaluation.tasks import score_completions
from ..generation import DiffusionGenerationConfig, decode_prompts
from .model import load_toy, toy_generation_config
from .task import toy_dataset, toy_reward


def _scored(decoded, dataset, reward) -> dict:
    """The keys :func:`evaluate_accuracy` returns, from ``decoded`` (a :class:`~dllm_trl.generation.DecodedPrompts`
    of ``dataset``'s prompts) scored with ``reward``."""
    rewards = score_completions(reward, decoded.completions, dataset)
    return dict(
        accuracy=sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
        tokens_per_second=decoded.tokens / decoded.seconds if decoded.seconds > 0 else float("nan"),
        nfe=decoded.nfe,
        seconds=decoded.seconds,
        num_problems=len(rewards),
        completions=decoded.completions,
    )


def evaluate_accuracy(
    model,
    tokenizer,
    dataset,
    generation_config: DiffusionGenerationConfig | None = None,
    batch_size: int = 64,
    reward=toy_reward,
) -> dict:
    """Decode every prompt of ``dataset`` with the diffusion sampler and score it with ``reward`` (a TRL reward
    function called with the dataset's other columns: :func:`toy_reward` reads ``answer``, ``sudoku_reward``
    ``puzzle``).

    Returns ``accuracy`` (share of reward 1), ``tokens_per_second`` (completion tokens up to and including EOS, per
    second of sampler time), ``nfe`` (model forwards, all batches together), ``seconds``, ``num_problems`` and the
    decoded ``completions``.
    """
    config = generation_config or toy_generation_config()
    return _scored(decode_prompts(model, tokenizer, list(dataset["prompt"]), config, batch_size), dataset, reward)


def evaluate_causal_accuracy(model, tokenizer, dataset, max_new_tokens: int, batch_size: int = 64,
                             reward=toy_reward) -> dict:
    """Greedy left-to-right decoding (``model.generate``) of every prompt of ``dataset``, scored like
    :func:`evaluate_accuracy` (same keys; ``nfe`` counts one forward per generated position)."""

    def generate(input_ids, attention_mask):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        new = out[:, input_ids.shape[1]:]
        is_eos = (new == tokenizer.eos_token_id).long()
        through_eos = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
        return new, through_eos, new.shape[1]

    decoded = decode_prompts(model, tokenizer, list(dataset["prompt"]), batch_size=batch_size, generate=generate)
    return _scored(decoded, dataset, reward)


def evaluate_diffusion_gemma_accuracy(model, tokenizer, dataset, sampler_config=None, batch_size: int = 200,
                                      reward=None, seeds=(0, 1, 2)) -> dict:
    """Decode every prompt of ``dataset`` with :class:`~dllm_trl.generation.DiffusionGemmaSampler` (default: the
    DiffusionGemma Sudoku toy's settings) once per seed in ``seeds`` (each seed's decoding draws from its own
    ``torch.Generator``, batch after batch) and score it with ``reward`` (default ``sudoku_reward``).

    DiffusionGemma's decoding is random (uniform-noise canvases, sampled tokens), so ``accuracy`` is the mean share of
    reward 1 over the seeds, ``accuracies`` the per-seed shares; ``nfe`` and ``seconds`` are summed over the seeds;
    ``tokens_per_second``, ``num_problems`` and ``completions`` are the first seed's; ``completions_per_seed`` holds
    every seed's (to score them with another reward without decoding again).
    """
    import torch

    from ..generation import DiffusionGemmaSampler
    from .model import sudoku_diffusion_gemma_sampler_config
    from .sudoku import sudoku_reward

    sampler = DiffusionGemmaSampler(sampler_config or sudoku_diffusion_gemma_sampler_config())
    device = model.get_input_embeddings().weight.device
    results = []
    for seed in seeds:
        generator = torch.Generator(device=device).manual_seed(seed)

        def generate(input_ids, attention_mask):
            out = sampler(model, input_ids, attention_mask, generator)
            return out.completion_ids, out.completion_mask, out.nfe

        decoded = decode_prompts(model, tokenizer, list(dataset["prompt"]), batch_size=batch_size, generate=generate)
        results.append(_scored(decoded, dataset, reward or sudoku_reward))
    first = results[0]
    return dict(
        accuracy=sum(r["accuracy"] for r in results) / len(results),
        accuracies=[r["accuracy"] for r in results],
        tokens_per_second=first["tokens_per_second"],
        nfe=sum(r["nfe"] for r in results),
        seconds=sum(r["seconds"] for r in results),
        num_problems=first["num_problems"],
        completions=first["completions"],
        completions_per_seed=[r["completions"] for r in results],
    )


def main(argv: list[str] | None = None) -> dict:
    """Decode toy problems with the shipped checkpoint and print accuracy and tokens/s."""
    parser = argparse.ArgumentParser(prog="python -m dllm_trl.toy", description=main.__doc__)
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--size", type=int, default=None, help="first N problems of the split (default: all)")
    parser.add_argument("--conversational", action="store_true", help="chat-template prompts instead of plain text")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--examples", type=int, default=5, help="problems to print")
    args = parser.parse_args(argv)

    model, tokenizer = load_toy(args.device)
    dataset = toy_dataset(args.split, size=args.size, conversational=args.conversational)
    result = evaluate_accuracy(model, tokenizer, dataset, batch_size=args.batch_size)
    for row, completion in list(zip(dataset, result["completions"]))[: args.examples]:
        prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        mark = "ok" if completion == row["answer"] else f"expected {row['answer']}"
        print(f"{prompt}{completion}  ({mark})")
    print(
        f"{args.split} split, {result['num_problems']} problems: accuracy {result['accuracy']:.3f}, "
        f"{result['tokens_per_second']:.0f} tokens/s, {result['nfe']} forwards in {result['seconds']:.2f} s"
    )
    return result
