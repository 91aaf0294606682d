"""Any supported diffusion LM as a model of EleutherAI's lm-evaluation-harness (``lm-eval``, the ``eval`` extra).

Importing this module registers :class:`DiffusionLM` with lm-eval as ``dllm_trl``; running it registers the model and
hands the command line over to lm-eval's own, with ``--model dllm_trl`` unless another ``--model`` is named::

    python -m dllm_trl.evaluation.lm_eval --model_args pretrained=GSAI-ML/LLaDA-8B-Instruct,dtype=bfloat16 \\
        --tasks gsm8k --apply_chat_template --gen_kwargs gen_length=256,block_length=32 --output_path eval/

The model loads through :func:`~dllm_trl.models.load_model_and_tokenizer` (every supported family, LoRA adapter
folders included) and decodes with its family's sampler: :class:`~dllm_trl.generation.MaskedDiffusionSampler` for
masked-diffusion and block-diffusion models, :class:`~dllm_trl.generation.DiffusionGemmaSampler` for DiffusionGemma.

Sampler settings come, later ones winning, from the model's own settings where the library has them (the shipped toys'
``toy_generation_config`` and kin; else the config's defaults, with a block model's attention block as the block),
then ``--model_args``, then the task's ``generation_kwargs`` and ``--gen_kwargs``. Without an explicit ``gen_length``
the canvas is ``max_gen_toks`` rounded up to whole blocks (canvases for DiffusionGemma); the completion is then cut to
``max_gen_toks`` tokens and at the first ``until`` string. ``do_sample=false`` means temperature 0 (greedy) for
masked diffusion; DiffusionGemma always samples (its t_max → t_min schedule), so a greedy request is refused unless
``--model_args sample_when_greedy=true``. Its draws (and a sampled masked-diffusion decoding) come from a generator
seeded with ``seed`` (model_args, default 0) at each ``generate_until`` call.

Tasks scored by likelihood (multiple choice: ``loglikelihood``; perplexity: ``loglikelihood_rolling``) are refused: a
diffusion LM gives only a bound on a sequence's likelihood, which the library does not estimate.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while it is empty)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

MODEL_NAME = "dllm_trl"

LOADING_ARGS = ("pretrained", "revision", "dtype", "attn_implementation", "device", "batch_size", "max_batch_size",
                "seed", "sample_when_greedy")
MASKED_SAMPLER_ARGS = ("gen_length", "block_length", "unmasking", "threshold", "steps", "temperature", "top_p", "top_k",
                       "min_p", "sampling", "cache", "stop_at_eos", "reference_decoder")
GEMMA_SAMPLER_ARGS = ("gen_length", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                      "confidence_threshold")
REQUEST_ARGS = ("until", "max_gen_toks", "do_sample", "temperature")
"""lm-eval's own generation keywords, read from each request beside the sampler's."""

LIKELIHOOD_REFUSAL = (
    "{method}: the dllm_trl lm-eval model decodes (generate_until tasks such as gsm8k, minerva_math, humaneval, mbpp, "
    "ifeval) but does not score likelihoods, which multiple-choice tasks (hellaswag, arc, mmlu, ...) and perplexity "
    "tasks (wikitext, lambada) need: a diffusion LM gives only a bound (ELBO) on a sequence's likelihood, which the "
    "library does not estimate, rather than report a biased number. Evaluate generation tasks, or use a task's "
    "generative variant (e.g. mmlu_generative)."
)


def shipped_sampler_config(path: str):
    """The library's own sampler settings of a shipped toy checkpoint at ``path``; None for any other checkpoint."""
    from ..toy import (sudoku_diffusion_gemma_sampler_config, sudoku_generation_config, toy_assets_dir,
                       toy_generation_config)
    from ..toy.block import toy_block_generation_config

    settings = {"toy": toy_generation_config, "toy_block": toy_block_generation_config,
                "sudoku": sudoku_generation_config, "sudoku_noisy_teacher": sudoku_generation_config,
                "sudoku_diffusion_gemma": sudoku_diffusion_gemma_sampler_config,
                "sudoku_diffusion_gemma_noisy_teacher": sudoku_diffusion_gemma_sampler_config}
    if not Path(path).is_dir():
        return None
    for name, make in settings.items():
        if Path(path).resolve() == toy_assets_dir(name).resolve():
            return make()
    return None


def _parse_until(until) -> list[str]:
    if until is None:
        return []
    if isinstance(until, str):
        return [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
        raise ValueError(f"until={until!r}: expected a string or a list of strings (the stop sequences).")
    return list(until)


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any non-empty stop string in ``until``."""
    cut = min((i for i in (text.find(s) for s in until if s) if i >= 0), default=len(text))
    return text[:cut]


class DiffusionLM(LM):
    """lm-eval model over the library's diffusion LMs: ``generate_until`` decodes with the family's sampler; the
    likelihood requests are refused (module docstring)."""

    def __init__(self, pretrained: str | None = None, revision: str = "main", dtype: str = "auto",
                 attn_implementation: str | None = None, device: str | None = None, batch_size: int | str | None = 16,
                 max_batch_size: int | None = None, seed: int = 0, sample_when_greedy: bool = False,
                 **sampler_args):
        super().__init__()
        from trl import ModelConfig

        from ..models.diffusion_gemma import is_diffusion_gemma
        from ..models import load_model_and_tokenizer
        from ..toy import toy_assets_dir

        if batch_size is None:
            batch_size = 16
        if isinstance(batch_size, str) and batch_size.isdigit():
            batch_size = int(batch_size)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: the dllm_trl model needs a positive integer batch size "
                             "(lm-eval's 'auto' search is not supported); pass --batch_size 16, say.")
        if max_batch_size is not None:
            raise ValueError("max_batch_size applies to lm-eval's --batch_size auto, which the dllm_trl model does not "
                             "support; drop it and set --batch_size.")
        self.path = str(pretrained or toy_assets_dir())
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: no CUDA device here; pass --device cpu.")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("The dllm_trl lm-eval model runs in one process (every process would decode every "
                             "request): launch it with python, not accelerate launch / torchrun.")
        self._rank, self._world_size = 0, 1
        self.batch_size = batch_size
        self.seed = int(seed)
        self.sample_when_greedy = bool(sample_when_greedy)
        model_args = ModelConfig(model_name_or_path=self.path, model_revision=revision, dtype=dtype,
                                 attn_implementation=attn_implementation)
        self.model, self.tokenizer = load_model_and_tokenizer(model_args, str(self._device))
        self.is_gemma = is_diffusion_gemma(self.model)
        self.sampler_keys = GEMMA_SAMPLER_ARGS if self.is_gemma else MASKED_SAMPLER_ARGS
        self.base_config = self._base_config(self._sampler_args(sampler_args, "--model_args"))

    # ----------------------------------------------------------------------------------------------------- settings

    def _sampler_args(self, args: dict, where: str) -> dict:
        unknown = sorted(set(args) - set(self.sampler_keys))
        if unknown:
            family = "DiffusionGemma" if self.is_gemma else "masked-diffusion"
            raise ValueError(f"{where}: {', '.join(unknown)} not understood by the dllm_trl model ({family} sampler); "
                             f"it reads {', '.join(self.sampler_keys)} (and {', '.join(LOADING_ARGS)} in --model_args, "
                             f"{', '.join(k for k in REQUEST_ARGS if k not in self.sampler_keys)} in "
                             "gen_kwargs).")
        return dict(args)

    def _base_config(self, overrides: dict):
        """The sampler config every request starts from: the library's settings for this checkpoint (or the
        config's defaults) with ``overrides`` (``--model_args``) applied; ``self.explicit_gen_length`` records
        whether the length was named."""
        from ..generation import DiffusionGemmaSamplerConfig, DiffusionGenerationConfig
        from ..models.bidirectional import diffusion_block_size

        self.explicit_gen_length = "gen_length" in overrides
        config = shipped_sampler_config(self.path)
        if config is None and self.is_gemma:
            config = DiffusionGemmaSamplerConfig()
        if config is None:
            block = diffusion_block_size(self.model)
            config = DiffusionGenerationConfig(**({} if block is None else
                                                  dict(block_length=block, gen_length=math.lcm(256, block))))
        return self._with(config, overrides)

    @staticmethod
    def _with(config, overrides: dict):
        """``config`` with ``overrides``; a static ``steps`` count the overrides leave alone follows a new length
        (one token per step) rather than go stale."""
        names = {f.name for f in fields(config)}
        assert set(overrides) <= names, overrides
        if "gen_length" in overrides and "steps" in names and "steps" not in overrides:
            overrides = {**overrides, "steps": None}
        return replace(config, **overrides)

    def _unit(self, config) -> int:
        """Granularity of ``gen_length``: whole canvases (DiffusionGemma) or whole decoding and attention blocks."""
        from ..models.bidirectional import diffusion_block_size

        if self.is_gemma:
            return int(self.model.config.canvas_length)
        return math.lcm(config.block_length, diffusion_block_size(self.model) or 1)

    def request_settings(self, gen_kwargs: dict) -> tuple:
        """``(sampler config, until, max_gen_toks)`` of one request's ``gen_kwargs``."""
        gen_kwargs = dict(gen_kwargs)
        until = _parse_until(gen_kwargs.pop("until", None))
        max_gen_toks = gen_kwargs.pop("max_gen_toks", None)
        do_sample = gen_kwargs.pop("do_sample", None)
        temperature = gen_kwargs.pop("temperature", None)
        overrides = self._sampler_args(gen_kwargs, "gen_kwargs")
        if self.is_gemma:
            greedy = do_sample is False or (temperature is not None and float(temperature) == 0.0)
            if temperature is not None and float(temperature) > 0:
                raise ValueError(f"temperature={temperature}: DiffusionGemma's temperature is its schedule t_max → "
                                 "t_min; set t_min / t_max in --gen_kwargs instead.")
            if greedy and not self.sample_when_greedy:
                raise ValueError("The task asks for greedy decoding (do_sample=false / temperature=0), which "
                                 "DiffusionGemma does not have: its decoding samples (uniform-noise canvases, "
                                 "temperatures t_max → t_min). Pass --model_args sample_when_greedy=true to decode "
                                 "it with the sampler's schedule (results then vary with seed).")
        else:
            if temperature is not None:
                overrides["temperature"] = float(temperature)
            if do_sample is False:
                if overrides.get("temperature", 0.0) > 0:
                    raise ValueError(f"do_sample=false with temperature={overrides['temperature']}: greedy decoding "
                                     "has temperature 0; drop one of them.")
                overrides["temperature"] = 0.0
            elif do_sample is True and overrides.get("temperature", self.base_config.temperature) == 0:
                raise ValueError("do_sample=true needs temperature > 0 (set temperature in --gen_kwargs).")
        explicit_length = self.explicit_gen_length or "gen_length" in overrides
        config = self._with(self.base_config, overrides)
        if max_gen_toks is not None:
            max_gen_toks = int(max_gen_toks)
            if max_gen_toks < 1:
                raise ValueError(f"max_gen_toks={max_gen_toks} must be ≥ 1.")
            if not explicit_length:
                unit = self._unit(config)
                config = self._with(config, {"gen_length": unit * math.ceil(max_gen_toks / unit)})
        return config, until, max_gen_toks

    # ------------------------------------------------------------------------------------------------- requests

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode every request's context; requests with the same settings are batched together (in order)."""
        from ..generation import DiffusionGemmaSampler, MaskedDiffusionSampler, decode_prompts

        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        results: list[str] = [""] * len(requests)
        for rows in groups.values():
            config, until, max_gen_toks = self.request_settings(requests[rows[0]].args[1])
            sampler = DiffusionGemmaSampler(config) if self.is_gemma else MaskedDiffusionSampler(config)
            sampler.check_model(self.model)
            generator = torch.Generator(device=self._device).manual_seed(self.seed)
            greedy = not self.is_gemma and config.temperature == 0

            def generate(input_ids, attention_mask, sampler=sampler, generator=generator, greedy=greedy,
                         keep=max_gen_toks):
                out = sampler(self.model, input_ids, attention_mask, None if greedy else generator)
                return out.completion_ids[:, :keep], out.completion_mask[:, :keep], out.nfe

            prompts = [requests[i].args[0] for i in rows]
            decoded = decode_prompts(self.model, self.tokenizer, prompts, batch_size=self.batch_size,
                                     generate=generate)
            for i, text in zip(rows, decoded.completions):
                results[i] = cut_at_stop(text, until)
                self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(LIKELIHOOD_REFUSAL.format(method="loglikelihood"))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(LIKELIHOOD_REFUSAL.format(method="loglikelihood_rolling"))

    # --------------------------------------------------------------------------------------------- chat templates

    @property
    def tokenizer_name(self) -> str:
        return self.path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not chat_template:
            return None
        if isinstance(chat_template, str):
            raise ValueError(f"--apply_chat_template {chat_template!r}: the dllm_trl model uses its tokenizer's own "
                             "chat template; pass --apply_chat_template without a name.")
        if not self.tokenizer.chat_template:
            raise ValueError(f"--apply_chat_template: the tokenizer of {self.path} has no chat template.")
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over ``chat_history`` as text (special tokens written out; the prompt is then
        tokenized without adding any)."""
        self.chat_template(True)
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line with the dllm_trl model registered (and chosen unless ``--model`` names another; the
    device, unless ``--device`` names one, is cuda where there is one, else cpu: lm-eval's own default is cuda)."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] not in (["ls"], ["validate"]):
        for flag, default in (("--model", MODEL_NAME), ("--device", "cuda" if torch.cuda.is_available() else "cpu")):
            if not any(a == flag or a.startswith(flag + "=") for a in args):
                args += [flag, default]
    sys.argv = [sys.argv[0] if argv is None else "python -m dllm_trl.evaluation.lm_eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    from dllm_trl.evaluation.lm_eval import main as registered_main  # the importable module registers the model once

    registered_main()
else:
    register_model(MODEL_NAME)(DiffusionLM)
