"""Greedy accuracy and decoding speed of the toy models (diffusion and causal) on the toy tasks."""

from __future__ import annotations

import argparse
import time

import torch

from ..generation import DiffusionGenerationConfig, diffusion_generate
from .model import load_toy, toy_generation_config
from .task import toy_dataset, toy_reward
from .tokenizer import encode_prompts


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """Completion texts up to (not including) the first EOS."""
    eos = tokenizer.eos_token_id
    return [
        tokenizer.decode([t for t in ids[mask.bool()].tolist() if t != eos], skip_special_tokens=False)
        for ids, mask in zip(completion_ids, completion_mask)
    ]


def score(reward, completions: list[str], dataset) -> list[float]:
    """``reward`` (a TRL reward function) on ``completions``, with every non-prompt column of ``dataset`` as keyword."""
    columns = {c: list(dataset[c]) for c in dataset.column_names if c != "prompt"}
    return [float(r) for r in reward(completions, **columns)]


def _decode_dataset(model, tokenizer, dataset, batch_size: int, decode, reward) -> dict:
    """The evaluation loop shared by both model kinds: ``decode(input_ids, attention_mask)`` returns
    ``(completion_ids, completion_mask, nfe)`` for one batch of prompts; the completions are scored with ``reward``."""
    device = model.get_input_embeddings().weight.device
    prompts = list(dataset["prompt"])
    completions, tokens, nfe, seconds = [], 0, 0, 0.0
    was_training = model.training
    model.eval()
    try:
        for begin in range(0, len(prompts), batch_size):
            input_ids, attention_mask = encode_prompts(tokenizer, prompts[begin : begin + batch_size])
            start = time.perf_counter()
            completion_ids, completion_mask, batch_nfe = decode(input_ids.to(device), attention_mask.to(device))
            completion_ids, completion_mask = completion_ids.cpu(), completion_mask.cpu()
            seconds += time.perf_counter() - start
            completions += decode_completions(tokenizer, completion_ids, completion_mask)
            tokens += int(completion_mask.sum())
            nfe += batch_nfe
    finally:
        model.train(was_training)
    rewards = score(reward, completions, dataset)
    return dict(
        accuracy=sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
        tokens_per_second=tokens / seconds if seconds > 0 else float("nan"),
        nfe=nfe,
        seconds=seconds,
        num_problems=len(rewards),
        completions=completions,
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

    def decode(input_ids, attention_mask):
        out = diffusion_generate(model, input_ids, attention_mask, config)
        return out.completion_ids, out.completion_mask, out.nfe

    return _decode_dataset(model, tokenizer, dataset, batch_size, decode, reward)


def evaluate_causal_accuracy(model, tokenizer, dataset, max_new_tokens: int, batch_size: int = 64,
                             reward=toy_reward) -> dict:
    """Greedy left-to-right decoding (``model.generate``) of every prompt of ``dataset``, scored like
    :func:`evaluate_accuracy` (same keys; ``nfe`` counts one forward per generated position)."""

    def decode(input_ids, attention_mask):
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out[:, input_ids.shape[1]:]
        is_eos = (new == tokenizer.eos_token_id).long()
        through_eos = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
        return new, through_eos, new.shape[1]

    return _decode_dataset(model, tokenizer, dataset, batch_size, decode, reward)


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
