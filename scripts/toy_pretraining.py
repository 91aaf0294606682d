"""The toys' pre-training (``scripts/pretrain_toy.py``, ``pretrain_toy_block.py``, ``pretrain_sudoku.py``): not part of
the installed package, which ships the checkpoints it wrote (``dllm_trl/assets``).

Deterministic masked-diffusion pre-training of the toy model (SPEC §1, paper 1 Eq. 2).

SFT-style: the prompt is never masked; the response region (the answer followed by EOS up to
``TOY_GEN_LENGTH`` positions, LLaDA's convention, EOS positions trained too) is masked token by token with
probability ``t ~ U(eps, 1]`` drawn per sequence, and the loss is the cross-entropy on the masked positions
weighted by ``1/t``. A fifth of the examples use the chat template, the rest the plain prompt, so both
dataset formats work. Training stops at the first evaluation whose greedy held-out accuracy reaches
``target_accuracy``: a partly competent model that reinforcement learning can still improve.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dllm_trl.generation import encode_prompts
from dllm_trl.losses.packed_states import pack_block_copies, packed_read_positions
from dllm_trl.models import attention_mask_dtype, token_logps_at
from dllm_trl.toy.block import TOY_BLOCK_MODEL_SHAPE, TOY_BLOCK_SIZE, toy_block_generation_config
from dllm_trl.toy.evaluate import evaluate_accuracy
from dllm_trl.toy.model import TOY_GEN_LENGTH, TOY_MODEL_SHAPE, toy_generation_config
from dllm_trl.toy.task import toy_dataset, toy_problems
from dllm_trl.toy.tokenizer import build_toy_tokenizer
from tests.tiny_models import build_tiny_llada, build_tiny_sdar


@dataclass
class ToyPretrainConfig:
    """Settings of :func:`pretrain_toy` (the defaults produce the shipped checkpoint)."""

    seed: int = 0
    batch_size: int = 128
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mask_eps: float = 1e-3
    chat_fraction: float = 0.2
    max_steps: int = 3000
    eval_every: int = 25
    target_accuracy: float = 0.3
    eval_batch_size: int = 200


def encode_training_set(tokenizer, gen_length: int = TOY_GEN_LENGTH, problems=None) -> dict[str, torch.Tensor]:
    """A train split (``problems``: ``(prompt, answer)`` pairs, by default the addition task's) as tensors:
    ``prompt_ids``/``prompt_mask`` (2, N, P) for the plain (0) and chat (1) formats, left-padded to one width P,
    and ``response_ids`` (N, gen_length) = answer ⊕ EOS padding."""
    problems = toy_problems("train") if problems is None else problems
    plain = [p for p, _ in problems]
    chat = [[{"role": "user", "content": p}] for p in plain]
    ids, mask = encode_prompts(tokenizer, plain + chat)
    eos = tokenizer.eos_token_id
    responses = []
    for _, answer in problems:
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(answer_ids) >= gen_length:
            raise ValueError(f"answer {answer!r} does not fit {gen_length} positions with an EOS.")
        responses.append(answer_ids + [eos] * (gen_length - len(answer_ids)))
    n = len(problems)
    return dict(
        prompt_ids=ids.view(2, n, -1),
        prompt_mask=mask.view(2, n, -1),
        response_ids=torch.tensor(responses, dtype=torch.long),
    )


def masked_diffusion_loss(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    mask_token_id: int,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
) -> torch.Tensor:
    """Paper 1 Eq. (2) on the last ``response_length`` positions of each row (the prompt is never masked).

    ``t ~ U(eps, 1]`` per row; each response token is replaced by ``M`` with probability ``t``; the loss is
    ``Σ_masked CE / t`` divided by the number of response positions in the batch.
    """
    batch = input_ids.shape[0]
    response = input_ids[:, -response_length:]
    t = eps + (1 - eps) * torch.rand(batch, 1, generator=generator, device=input_ids.device)
    masked = torch.rand(batch, response_length, generator=generator, device=input_ids.device) < t
    noisy = input_ids.clone()
    noisy[:, -response_length:] = response.masked_fill(masked, mask_token_id)
    logits = model(input_ids=noisy, attention_mask=attention_mask, logits_to_keep=response_length).logits
    token_loss = F.cross_entropy(logits.float().transpose(1, 2), response, reduction="none")
    return (token_loss * masked / t).sum() / response.numel()


def pretrain_toy(output_dir: str | Path, config: ToyPretrainConfig | None = None, log=print):
    """Train the toy model from scratch and save model + tokenizer to ``output_dir``; returns a summary dict."""
    cfg = config or ToyPretrainConfig()

    def build(tokenizer):
        return build_tiny_llada(
            mask_token_id=tokenizer.mask_token_id,
            seed=cfg.seed,
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            max_position_embeddings=tokenizer.model_max_length,
            **TOY_MODEL_SHAPE,
        )

    def batch_loss(model, tokenizer, prompt_ids, prompt_mask, response_ids, generator):
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)
        return masked_diffusion_loss(
            model, input_ids, attention_mask, TOY_GEN_LENGTH, tokenizer.mask_token_id, generator, cfg.mask_eps
        )

    return run_pretraining(output_dir, cfg, build, batch_loss, toy_generation_config(), log)


def run_pretraining(output_dir: str | Path, cfg, build_model, batch_loss, generation_config, log=print, *,
                    train_problems=None, gen_length: int = TOY_GEN_LENGTH, evaluate=None) -> dict:
    """The toy models' shared pre-training loop, with deterministic algorithms; saves model + tokenizer.

    ``cfg``: a :class:`ToyPretrainConfig`; ``build_model(tokenizer)`` makes the model (after
    ``torch.manual_seed(cfg.seed)``); ``batch_loss(model, tokenizer, prompt_ids, prompt_mask, response_ids,
    generator)`` is the objective of one batch of the train split (a fraction ``cfg.chat_fraction`` in the chat
    format); ``generation_config`` decodes the held-out evaluations. Training stops at the first evaluation whose
    greedy accuracy reaches ``cfg.target_accuracy``. The task is the addition toy unless ``train_problems``
    (``(prompt, answer)`` pairs, answers padded with EOS to ``gen_length``) and ``evaluate(model, tokenizer)`` (the
    held-out greedy accuracy) name another.
    """
    if evaluate is None:
        test_set = toy_dataset("test")

        def evaluate(model, tokenizer):
            return evaluate_accuracy(model, tokenizer, test_set, generation_config, cfg.eval_batch_size)["accuracy"]

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _pretrain(Path(output_dir), cfg, build_model, batch_loss, evaluate, log, train_problems, gen_length)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _pretrain(output_dir: Path, cfg, build_model, batch_loss, evaluate, log, train_problems, gen_length) -> dict:
    torch.manual_seed(cfg.seed)
    tokenizer = build_toy_tokenizer()
    model = build_model(tokenizer)
    model.config.bos_token_id = tokenizer.bos_token_id
    data = encode_training_set(tokenizer, gen_length, train_problems)
    num_examples = data["response_ids"].shape[0]

    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / cfg.warmup_steps))
    order = torch.randperm(num_examples, generator=generator)
    cursor, history, accuracy = 0, [], 0.0
    start = time.perf_counter()
    model.train()
    for step in range(1, cfg.max_steps + 1):
        if cursor + cfg.batch_size > num_examples:
            order, cursor = torch.randperm(num_examples, generator=generator), 0
        index = order[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        chat = (torch.rand(cfg.batch_size, generator=generator) < cfg.chat_fraction).long()
        loss = batch_loss(model, tokenizer, data["prompt_ids"][chat, index], data["prompt_mask"][chat, index],
                          data["response_ids"][index], generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

        if step % cfg.eval_every == 0:
            accuracy = evaluate(model, tokenizer)
            history.append(dict(step=step, loss=round(loss.item(), 4), accuracy=accuracy))
            log(f"step {step:5d}  loss {loss.item():.4f}  held-out accuracy {accuracy:.3f}  "
                f"({time.perf_counter() - start:.0f} s)")
            if accuracy >= cfg.target_accuracy:
                break
    seconds = time.perf_counter() - start

    model.eval()
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    summary = dict(steps=step, test_accuracy=accuracy, config=asdict(cfg), history=history)
    (output_dir / "pretrain_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return dict(summary, seconds=seconds)


def pretraining_cli(description: str, config_class, pretrain, default_output: Path, argv=None) -> None:
    """The pre-training scripts' command line: ``--output-dir``, ``--threads`` and one flag per field of
    ``config_class``; runs ``pretrain(output_dir, config)`` and prints where the checkpoint went.
    ``default_output`` is a folder, or a function of the config giving one."""
    import argparse
    from dataclasses import fields

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=None, help="default: the shipped checkpoint's folder")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results depend on it)")
    for f in fields(config_class):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = config_class(**{f.name: getattr(args, f.name) for f in fields(config_class)})
    if args.output_dir is None:
        args.output_dir = Path(default_output(config) if callable(default_output) else default_output)
    summary = pretrain(args.output_dir, config)
    size = sum(p.stat().st_size for p in args.output_dir.glob("*.safetensors")) / 2**20
    print(
        f"saved {args.output_dir} ({size:.2f} MB of weights) after {summary['steps']} steps in "
        f"{summary['seconds']:.0f} s; held-out accuracy {summary['test_accuracy']:.3f}"
    )


def causal_lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                   eos_token_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over the last ``response_length`` positions up to and including the first EOS."""
    response = input_ids[:, -response_length:]
    is_eos = (response == eos_token_id).long()
    trained = (is_eos.cumsum(1) - is_eos) == 0
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=response_length + 1).logits
    token_loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), response, reduction="none")
    return (token_loss * trained).sum() / trained.sum().clamp_min(1)


def uniform_noise_denoising_loss(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    generator: torch.Generator | None = None,
    self_conditioning_prob: float = 0.5,
    temperature_range: tuple[float, float] = (0.4, 0.8),
) -> torch.Tensor:
    """DiffusionGemma's denoising objective on one canvas (the response, ``canvas_length`` tokens; SPEC §8).

    Per row ``t ~ U(0, 1)``; each response token is replaced by a uniform random token of the vocabulary with
    probability ``t`` (the noise its sampler starts from and re-draws off the accept set; there is no mask token), and
    the loss is the mean cross-entropy of the clean response over every canvas position (a noise token can equal the
    clean one, so no position is known to be clean). Self-conditioning as the sampler uses it: for a random
    ``self_conditioning_prob`` of the rows the decoder also reads the softmax of a no-gradient first pass's logits
    divided by a temperature drawn from ``temperature_range`` (the sampler's ``t_min``–``t_max``); the other rows read
    zeros, as a canvas's first step does. The prompt (left-padded) is encoded causally and never noised; its padding is
    masked for the decoder too.
    """
    batch, length = response_ids.shape
    vocab = model.config.get_text_config().vocab_size
    device = response_ids.device
    t = torch.rand(batch, 1, generator=generator, device=device)
    noised = torch.rand(batch, length, generator=generator, device=device) < t
    noise = torch.randint(0, vocab, (batch, length), generator=generator, device=device)
    canvas = torch.where(noised, noise, response_ids)
    use_self_conditioning = torch.rand(batch, generator=generator, device=device) < self_conditioning_prob
    low, high = temperature_range
    temperature = low + (high - low) * torch.rand(batch, 1, 1, generator=generator, device=device)
    inputs = dict(input_ids=prompt_ids, attention_mask=prompt_mask, decoder_input_ids=canvas,
                  decoder_attention_mask=torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1))
    self_conditioning = None
    if use_self_conditioning.any():
        with torch.no_grad():
            self_conditioning = model(**inputs).logits / temperature
    logits = model(**inputs, self_conditioning_logits=self_conditioning,
                   self_conditioning_mask=use_self_conditioning if self_conditioning is not None else None).logits
    return F.cross_entropy(logits.float().transpose(1, 2), response_ids)


SUDOKU_MODEL_KINDS = ("diffusion", "causal", "diffusion_gemma")


@dataclass
class SudokuPretrainConfig(ToyPretrainConfig):
    """Settings of :func:`pretrain_sudoku` (the defaults, with ``model_kind``, produce the shipped checkpoints).
    Training stops on the validation split's greedy solve rate, so the test split stays held out;
    ``max_train_blanks`` < 12 pre-trains on the easier train puzzles only (the evaluation stays on the full split);
    ``relabel_fraction`` > 0 pre-trains on a noisy teacher's answers
    (:func:`~dllm_trl.toy.sudoku.noisy_teacher_problems`: that share has 1 and 2 exchanged) and stops on the
    validation solve rate up to that relabelling (the main job's checkpoint, ``assets/sudoku_noisy_teacher``)."""

    model_kind: str = "diffusion"
    eval_every: int = 10
    target_accuracy: float = 0.25
    max_train_blanks: int = 12
    relabel_fraction: float = 0.0

    def __post_init__(self):
        if self.model_kind not in SUDOKU_MODEL_KINDS:
            raise ValueError(f"model_kind={self.model_kind!r}: expected one of {SUDOKU_MODEL_KINDS}.")
        if self.max_train_blanks < 1:
            raise ValueError(f"max_train_blanks={self.max_train_blanks}: expected ≥ 1.")
        if not 0.0 <= self.relabel_fraction < 1.0:
            raise ValueError(f"relabel_fraction={self.relabel_fraction}: expected a share in [0, 1) of the train "
                             "answers (0 = the clean teacher).")


def pretrain_sudoku(output_dir: str | Path, config: SudokuPretrainConfig | None = None, log=print) -> dict:
    """Train a Sudoku toy from scratch (a LLaDA-shaped diffusion LM, with ``model_kind="causal"`` a plain
    left-to-right ``LlamaForCausalLM`` of the same shape, with ``model_kind="diffusion_gemma"`` a tiny
    ``DiffusionGemmaForBlockDiffusion`` trained by :func:`uniform_noise_denoising_loss`, its answer one canvas) and save
    model + tokenizer to ``output_dir``."""
    if (config or SudokuPretrainConfig()).model_kind == "diffusion_gemma":
        return _pretrain_sudoku_diffusion_gemma(output_dir, config, log)
    from transformers import LlamaForCausalLM

    from dllm_trl.toy.evaluate import evaluate_causal_accuracy
    from dllm_trl.toy.model import SUDOKU_GEN_LENGTH, SUDOKU_MODEL_SHAPE, sudoku_generation_config
    from dllm_trl.toy.sudoku import noisy_teacher_problems, sudoku_dataset, sudoku_problems, sudoku_reward
    from dllm_trl.toy.sudoku import sudoku_up_to_relabelling_reward
    from tests.tiny_models import tiny_llada_config

    cfg = config or SudokuPretrainConfig()
    causal = cfg.model_kind == "causal"

    def build(tokenizer):
        shape = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     max_position_embeddings=tokenizer.model_max_length, **SUDOKU_MODEL_SHAPE)
        if not causal:
            return build_tiny_llada(mask_token_id=tokenizer.mask_token_id, seed=cfg.seed, **shape)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = LlamaForCausalLM(tiny_llada_config(**shape))
        model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
        return model

    def batch_loss(model, tokenizer, prompt_ids, prompt_mask, response_ids, generator):
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)
        if causal:
            return causal_lm_loss(model, input_ids, attention_mask, SUDOKU_GEN_LENGTH, tokenizer.eos_token_id)
        return masked_diffusion_loss(model, input_ids, attention_mask, SUDOKU_GEN_LENGTH, tokenizer.mask_token_id,
                                     generator, cfg.mask_eps)

    validation = sudoku_dataset("validation")
    # The stop rule decodes with the dynamic threshold (the shipped checkpoint was stopped on it; fewer forwards per
    # evaluation than one cell per step, and at the stop both give the same validation solve rate, 0.25).
    generation_config = sudoku_generation_config(unmasking="dynamic", threshold=0.9, steps=None)

    # with a noisy teacher, stop on competence: solved in either convention (RL's job is to pick the right one)
    reward = sudoku_up_to_relabelling_reward if cfg.relabel_fraction > 0 else sudoku_reward

    def evaluate(model, tokenizer):
        if causal:
            return evaluate_causal_accuracy(model, tokenizer, validation, SUDOKU_GEN_LENGTH, cfg.eval_batch_size,
                                            reward)["accuracy"]
        return evaluate_accuracy(model, tokenizer, validation, generation_config, cfg.eval_batch_size,
                                 reward)["accuracy"]

    train_problems = sudoku_problems("train", cfg.max_train_blanks)
    if cfg.relabel_fraction > 0:
        train_problems = noisy_teacher_problems(train_problems, cfg.relabel_fraction, seed=cfg.seed)
    return run_pretraining(output_dir, cfg, build, batch_loss, generation_config, log,
                           train_problems=train_problems, gen_length=SUDOKU_GEN_LENGTH, evaluate=evaluate)


def _pretrain_sudoku_diffusion_gemma(output_dir: str | Path, cfg: SudokuPretrainConfig, log=print) -> dict:
    from dllm_trl.toy.evaluate import evaluate_diffusion_gemma_accuracy
    from dllm_trl.toy.model import SUDOKU_DIFFUSION_GEMMA_SHAPE, SUDOKU_GEN_LENGTH, configure_diffusion_gemma_generation
    from dllm_trl.toy.sudoku import noisy_teacher_problems, sudoku_dataset, sudoku_problems, sudoku_reward
    from dllm_trl.toy.sudoku import sudoku_up_to_relabelling_reward

    def build(tokenizer):
        from tests.tiny_models import build_tiny_diffusion_gemma

        model = build_tiny_diffusion_gemma(
            seed=cfg.seed, vocab_size=len(tokenizer) + 3, canvas_length=SUDOKU_GEN_LENGTH,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, max_position_embeddings=tokenizer.model_max_length,
            **SUDOKU_DIFFUSION_GEMMA_SHAPE)
        configure_diffusion_gemma_generation(model)
        return model

    def batch_loss(model, tokenizer, prompt_ids, prompt_mask, response_ids, generator):
        return uniform_noise_denoising_loss(model, prompt_ids, prompt_mask, response_ids, generator)

    validation = sudoku_dataset("validation")

    def evaluate(model, tokenizer):  # the toy's sampler, its random draws from a fixed seed: a deterministic stop
        return evaluate_diffusion_gemma_accuracy(model, tokenizer, validation, batch_size=cfg.eval_batch_size,
                                                 reward=reward, seeds=(0,))["accuracy"]

    # with a noisy teacher, stop on competence: solved in either convention (RL's job is to pick the right one)
    reward = sudoku_up_to_relabelling_reward if cfg.relabel_fraction > 0 else sudoku_reward
    train_problems = sudoku_problems("train", cfg.max_train_blanks)
    if cfg.relabel_fraction > 0:
        train_problems = noisy_teacher_problems(train_problems, cfg.relabel_fraction, seed=cfg.seed)
    return run_pretraining(output_dir, cfg, build, batch_loss, None, log, train_problems=train_problems,
                           gen_length=SUDOKU_GEN_LENGTH, evaluate=evaluate)


# -- the toy block-diffusion model (SDAR layout) -----------------------------------------------------------------
# Block-diffusion SFT (the SDAR / Fast-dLLM v2 objective): each response block is masked with its own ratio
# t ~ U(eps, 1], every noisy block sees the clean blocks before it (one packed forward, the layout of
# dllm_trl.losses.packed_states), and the loss is the cross-entropy at the masked positions weighted by 1/t.


def block_diffusion_loss(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    mask_token_id: int,
    block_size: int,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
) -> torch.Tensor:
    """Block-diffusion SFT loss: ``t_b ~ U(eps, 1]`` per row and response block ``b``, each response token masked in
    its block's noisy copy with probability ``t_b``; ``Σ_masked CE / t_b`` over the number of response positions.

    One packed forward: prompt ⊕ the clean response's blocks but the last ⊕ a noisy copy of every block.
    """
    rows, length = response_ids.shape
    blocks = length // block_size
    device = response_ids.device
    t = eps + (1 - eps) * torch.rand(rows, blocks, 1, generator=generator, device=device)
    masked = torch.rand(rows, blocks, block_size, generator=generator, device=device) < t
    copies = response_ids.view(rows, blocks, block_size).masked_fill(masked, mask_token_id)
    copy_blocks = torch.arange(blocks, device=device).expand(rows, blocks)
    packed = pack_block_copies(
        prompt_ids, prompt_mask, response_ids[:, : (blocks - 1) * block_size], copies, copy_blocks,
        torch.ones(rows, blocks, dtype=torch.bool, device=device), block_size, mask_token_id,
        attention_mask_dtype(model),
    )
    own_block = torch.arange(length, device=device) // block_size == torch.arange(blocks, device=device)[:, None]
    read = masked.view(rows, 1, length) & own_block  # (rows, copy, position): the masked positions of each copy
    read_rows, read_columns, (r, j, i) = packed_read_positions(packed, read, shift=0)
    logps = token_logps_at(model, read_rows, read_columns, response_ids[r, i], input_ids=packed.input_ids,
                           attention_mask=packed.attention_mask, position_ids=packed.position_ids)
    weights = 1.0 / t.view(rows, blocks)[r, j]
    return -(logps * weights).sum() / response_ids.numel()


@dataclass
class ToyBlockPretrainConfig(ToyPretrainConfig):
    """Settings of :func:`pretrain_toy_block`: the toy's (the defaults produce the shipped checkpoint)."""


def pretrain_toy_block(output_dir: str | Path, config: ToyBlockPretrainConfig | None = None, log=print) -> dict:
    """Train the toy block model from scratch and save model + tokenizer to ``output_dir``; returns a summary.

    Stops at the first evaluation whose greedy held-out accuracy reaches ``target_accuracy`` (a partly competent
    model that RL can still improve). Deterministic algorithms throughout (the toy's loop,
    :func:`run_pretraining`).
    """
    cfg = config or ToyBlockPretrainConfig()

    def build(tokenizer):
        return build_tiny_sdar(
            mask_token_id=tokenizer.mask_token_id, block_size=TOY_BLOCK_SIZE, seed=cfg.seed,
            vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
            max_position_embeddings=tokenizer.model_max_length, **TOY_BLOCK_MODEL_SHAPE,
        )

    def batch_loss(model, tokenizer, prompt_ids, prompt_mask, response_ids, generator):
        return block_diffusion_loss(model, prompt_ids, prompt_mask, response_ids, tokenizer.mask_token_id,
                                    TOY_BLOCK_SIZE, generator, cfg.mask_eps)

    return run_pretraining(output_dir, cfg, build, batch_loss, toy_block_generation_config(), log)
