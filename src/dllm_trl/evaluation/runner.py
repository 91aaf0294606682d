"""Decode and score tasks over a grid of generation lengths and unmasking modes (paper 1's Table 2 / 3 cells)."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from ..generation import DiffusionGenerationConfig, decode_prompts
from .metrics import TaskAccuracy, check_sampling
from .tasks import EvalTask

PAPER_GEN_LENGTHS = (128, 256, 512)
TOY_GEN_LENGTHS = (4, 8, 16)
"""Toy counterpart of 128/256/512: half, equal to and twice the length the toy model was trained at."""


def decode(
    model, tokenizer, prompts: Sequence, config: DiffusionGenerationConfig, batch_size: int, desc: str | None = None
) -> dict:
    """:func:`~dllm_trl.generation.decode_prompts` with a progress bar named ``desc`` (none without).

    Returns ``completions`` (in the order of ``prompts``), ``tokens`` (completion tokens up to and including
    EOS), ``seconds`` (sampler time), ``nfe`` (forwards, all batches) and ``nfe_per_problem`` (forwards each
    prompt's decoding went through, averaged over prompts).
    """
    with tqdm(total=len(prompts), desc=desc, unit="completion", disable=desc is None) as bar:
        out = decode_prompts(model, tokenizer, prompts, config, batch_size, on_batch=bar.update)
    return dict(completions=out.completions, tokens=out.tokens, seconds=out.seconds, nfe=out.nfe,
                nfe_per_problem=out.nfe_per_prompt)


def generation_config(gen_length: int, unmasking: str, block_length: int = 32, threshold: float = 0.9,
                      tokens_per_step: int = 1, cache: str = "dual",
                      temperature: float = 0.0) -> DiffusionGenerationConfig:
    """Decoding settings of one cell (greedy unless ``temperature`` > 0); blocks never exceed the generation
    length."""
    block = min(block_length, gen_length)
    steps = gen_length // tokens_per_step if unmasking == "static" else None
    return DiffusionGenerationConfig(
        gen_length=gen_length, block_length=block, unmasking=unmasking, threshold=threshold, steps=steps,
        temperature=temperature, cache=cache,
    )


def evaluate_model(
    model,
    tokenizer,
    tasks: Sequence[EvalTask],
    gen_lengths: Sequence[int] = PAPER_GEN_LENGTHS,
    unmasking: Sequence[str] = ("dynamic", "static"),
    block_length: int = 32,
    threshold: float = 0.9,
    tokens_per_step: int = 1,
    cache: str = "dual",
    batch_size: int = 16,
    progress: bool = True,
    num_samples: int = 1,
    temperature: float = 0.0,
    pass_at: Sequence[int] = (),
) -> dict:
    """Decode and score every task at every (generation length, unmasking mode).

    Each problem is decoded ``num_samples`` times (``temperature`` > 0 when more than once: greedy decoding
    repeats itself); ``pass_at`` lists the k of the pass@k columns. Duplicate lengths or modes are evaluated once.

    Returns ``{"cells": [...], "completions": [...]}``: one cell per (task, length, mode) with ``accuracy``,
    ``mean_reward``, ``pass@k`` for each k of ``pass_at``, ``num_problems``, ``num_samples``,
    ``tokens_per_second``, ``nfe``, ``nfe_per_problem`` and ``seconds``; one completion record per (cell,
    problem, sample) with its ``reward``.
    """
    check_sampling(num_samples, temperature, pass_at)
    cells, records = [], []
    for task in tasks:
        prompts = [p for p in task.dataset["prompt"] for _ in range(num_samples)]
        for gen_length in dict.fromkeys(gen_lengths):
            for mode in dict.fromkeys(unmasking):
                config = generation_config(gen_length, mode, block_length, threshold, tokens_per_step, cache,
                                           temperature)
                desc = f"{task.name} · length {gen_length} · {mode}" if progress else None
                out = decode(model, tokenizer, prompts, config, batch_size, desc)
                rewards = task.score(out["completions"], num_samples)
                metric = TaskAccuracy(keep_in_memory=True)
                metric.add_batch(rewards=[rewards[i : i + num_samples] for i in range(0, len(rewards), num_samples)])
                cell = dict(
                    dataset=task.name,
                    gen_length=gen_length,
                    unmasking=mode,
                    **metric.compute(ks=list(pass_at)),
                    num_problems=len(task.dataset),
                    num_samples=num_samples,
                    tokens_per_second=out["tokens"] / out["seconds"] if out["seconds"] > 0 else float("nan"),
                    nfe=out["nfe"],
                    nfe_per_problem=out["nfe_per_problem"],
                    seconds=out["seconds"],
                )
                cells.append(cell)
                records += [
                    dict(dataset=task.name, gen_length=gen_length, unmasking=mode, index=i // num_samples,
                         sample=i % num_samples, completion=c, reward=r)
                    for i, (c, r) in enumerate(zip(out["completions"], rewards))
                ]
    return {"cells": cells, "completions": records}
