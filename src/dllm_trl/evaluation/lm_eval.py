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

Tasks scored by likelihood (multiple choice: ``loglikelihood``; perplexity: ``loglikelihood_rolling``) get the
masked-diffusion ELBO of :func:`~dllm_trl.losses.elbo.sequence_elbo`, set in ``--model_args``: ``estimator`` (``llada``,
the default: stratified masked counts, weight L/l; ``dream``: stratified mask ratios; ``left_to_right``: exact, one state
per token), ``mc_num`` (Monte-Carlo masks per request, 128), ``mc_batch_size`` (masks per forward, 32; divides
``mc_num``), ``cfg_scale`` (classifier-free guidance, 0 = off) and ``max_length`` (the rolling window of
``loglikelihood_rolling``; default: the model's context length). A one-token continuation is scored exactly. Each
request's masks come from a generator seeded with ``seed`` and the request's token ids, so a score depends on neither
the order of the requests nor the process that runs them. Block-diffusion models are scored block by block (earlier
blocks clean); DiffusionGemma (uniform noise, no mask token) is refused. ``is_greedy`` is True when every continuation
token is the model's argmax in its left-to-right state (context and earlier tokens clean, later tokens masked; within
its block on a block model), i.e. when decoding one token per step, left to right, greedily gives the continuation:
the library's own sampler unmasks by confidence and may decode another answer.

Under ``accelerate launch`` (several processes) each process takes lm-eval's share of the documents
(``rank`` / ``world_size``, as lm-eval's HF model) and the results are gathered on the first process.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while it is empty)
import torch
from lm_eval.api.model import LM, TemplateLM
from lm_eval.api.registry import register_model

MODEL_NAME = "dllm_trl"

LOADING_ARGS = ("pretrained", "revision", "dtype", "attn_implementation", "device", "batch_size", "max_batch_size",
                "seed", "sample_when_greedy", "chat_template_args")
LIKELIHOOD_ARGS = ("estimator", "mc_num", "mc_batch_size", "cfg_scale", "max_length")
"""``--model_args`` of the likelihood requests (module docstring)."""
MASKED_SAMPLER_ARGS = ("gen_length", "block_length", "unmasking", "threshold", "steps", "temperature", "top_p", "top_k",
                       "min_p", "sampling", "cache", "stop_at_eos", "reference_decoder")
GEMMA_SAMPLER_ARGS = ("gen_length", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                      "confidence_threshold")
REQUEST_ARGS = ("until", "max_gen_toks", "do_sample", "temperature")
"""lm-eval's own generation keywords, read from each request beside the sampler's."""

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
    """lm-eval model over the library's diffusion LMs: ``generate_until`` decodes with the family's sampler, the
    likelihood requests are scored with the masked-diffusion ELBO (module docstring)."""

    def __init__(self, pretrained: str | None = None, revision: str = "main", dtype: str = "auto",
                 attn_implementation: str | None = None, device: str | None = None, batch_size: int | str | None = 16,
                 max_batch_size: int | None = None, seed: int = 0, sample_when_greedy: bool = False,
                 estimator: str = "llada", mc_num: int = 128, mc_batch_size: int = 32, cfg_scale: float = 0.0,
                 max_length: int | None = None, chat_template_args: dict | None = None, **sampler_args):
        super().__init__()
        from trl import ModelConfig

        from ..families import family_of, load_model_and_tokenizer
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
        self._rank, self._world_size, self.accelerator = 0, 1, None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=self._device.type == "cpu")  # several CPU processes: gloo
            self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes
            if device is None:
                self._device = self.accelerator.device
        self.batch_size = batch_size
        self.seed = int(seed)
        self.sample_when_greedy = bool(sample_when_greedy)
        from ..losses.elbo import check_estimator

        self.estimator, self.mc_num, self.mc_batch_size = estimator, int(mc_num), int(mc_batch_size)
        check_estimator(self.estimator, self.mc_num, self.mc_batch_size)
        self.cfg_scale = float(cfg_scale)
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale={cfg_scale}: classifier-free guidance takes a scale ≥ 0 (0 = off).")
        self._max_length = None if max_length is None else int(max_length)
        self.chat_template_args = dict(chat_template_args or {})
        self._chat_template = None
        model_args = ModelConfig(model_name_or_path=self.path, model_revision=revision, dtype=dtype,
                                 attn_implementation=attn_implementation)
        self.model, self.tokenizer = load_model_and_tokenizer(model_args, str(self._device))
        self.family = family_of(self.model)
        self.greedy = self.family.greedy_decoding
        self.sampler_keys = MASKED_SAMPLER_ARGS if self.greedy else GEMMA_SAMPLER_ARGS
        self.base_config = self._base_config(self._sampler_args(sampler_args, "--model_args"))

    # ----------------------------------------------------------------------------------------------------- settings

    def _sampler_args(self, args: dict, where: str) -> dict:
        unknown = sorted(set(args) - set(self.sampler_keys))
        if unknown:
            family = self.family.name
            raise ValueError(f"{where}: {', '.join(unknown)} not understood by the dllm_trl model ({family} sampler); "
                             f"it reads {', '.join(self.sampler_keys)} (and {', '.join(LOADING_ARGS)} in --model_args, "
                             f"{', '.join(k for k in REQUEST_ARGS if k not in self.sampler_keys)} in "
                             "gen_kwargs).")
        return dict(args)

    def _base_config(self, overrides: dict):
        """The sampler config every request starts from: the library's settings for this checkpoint (or the
        config's defaults) with ``overrides`` (``--model_args``) applied; ``self.explicit_gen_length`` records
        whether the length was named."""
        self.explicit_gen_length = "gen_length" in overrides
        config = shipped_sampler_config(self.path)
        if config is None:
            config = self.family.sampler_config(self.model)
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
        return self.family.length_unit(self.model, config)

    def request_settings(self, gen_kwargs: dict) -> tuple:
        """``(sampler config, until, max_gen_toks)`` of one request's ``gen_kwargs``."""
        gen_kwargs = dict(gen_kwargs)
        until = _parse_until(gen_kwargs.pop("until", None))
        max_gen_toks = gen_kwargs.pop("max_gen_toks", None)
        do_sample = gen_kwargs.pop("do_sample", None)
        temperature = gen_kwargs.pop("temperature", None)
        overrides = self._sampler_args(gen_kwargs, "gen_kwargs")
        if not self.greedy:
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
        from ..generation import decode_prompts

        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        results: list[str] = [""] * len(requests)
        bar = self._progress(len(requests), "generate_until", disable_tqdm)
        for rows in groups.values():
            config, until, max_gen_toks = self.request_settings(requests[rows[0]].args[1])
            sampler = self.family.sampler_for(config)
            sampler.check_model(self.model)
            generator = torch.Generator(device=self._device).manual_seed(self.seed)
            greedy = self.greedy and config.temperature == 0

            def generate(input_ids, attention_mask, sampler=sampler, generator=generator, greedy=greedy,
                         keep=max_gen_toks):
                out = sampler(self.model, input_ids, attention_mask, None if greedy else generator)
                bar.update(input_ids.shape[0])
                return out.completion_ids[:, :keep], out.completion_mask[:, :keep], out.nfe

            prompts = [requests[i].args[0] for i in rows]
            decoded = decode_prompts(self.model, self.tokenizer, prompts, batch_size=self.batch_size,
                                     generate=generate)
            for i, text in zip(rows, decoded.completions):
                results[i] = cut_at_stop(text, until)
                self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        bar.close()
        return results

    def _progress(self, total: int, kind: str, disable: bool):
        """A progress bar over ``total`` requests, as lm-eval's HF model shows it (on the first process only)."""
        from tqdm import tqdm

        return tqdm(total=total, disable=disable or self._rank != 0, desc=f"Running {kind} requests")

    @property
    def prefix_token_id(self) -> int:
        """The context of an empty-context request (lm-eval's HF model: BOS, else EOS)."""
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Tokens per rolling window of ``loglikelihood_rolling`` (``max_length``, else the model's context)."""
        from lm_eval.models.utils import resolve_max_length

        from ..models.engines import model_config

        return self._max_length or resolve_max_length(model_config(self.model), self.tokenizer, default=2048)

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids as lm-eval's HF model splits them: trailing spaces of the context move to the
        continuation, the whole text is tokenized and cut after the context's tokens; an empty context is the prefix
        token."""
        if not context:
            continuation_ids = self.tok_encode(continuation)
            if continuation_ids[:1] == [self.prefix_token_id]:
                return continuation_ids[:1], continuation_ids[1:]
            return [self.prefix_token_id], continuation_ids
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return context_ids, whole[len(context_ids):]

    def score_tokens(self, context_ids: list[int], continuation_ids: list[int], with_greedy: bool = True):
        """The :class:`~dllm_trl.losses.elbo.ElboEstimate` of one request, from its own seeded generator."""
        from ..losses.elbo import sequence_elbo

        if not continuation_ids:
            raise ValueError("loglikelihood: the continuation is empty after tokenization; nothing to score.")
        return sequence_elbo(
            self.model, torch.tensor(context_ids, device=self._device),
            torch.tensor(continuation_ids, device=self._device), self.estimator, self.mc_num, self.mc_batch_size,
            request_generator(self.seed, context_ids, continuation_ids), self.cfg_scale, with_greedy=with_greedy)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(ELBO estimate of log p(continuation | context), is_greedy)`` per request (module docstring)."""
        results = []
        for request in self._progress_over(requests, "loglikelihood", disable_tqdm):
            context, continuation = request.args
            estimate = self.score_tokens(*self.encode_pair(context, continuation))
            results.append((estimate.value, estimate.greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, results[-1])
        return results

    def _progress_over(self, requests, kind: str, disable: bool):
        bar = self._progress(len(requests), kind, disable)
        for request in requests:
            yield request
            bar.update(1)
        bar.close()

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The ELBO estimate of a whole text: the sum over lm-eval's disjoint rolling windows of ``max_length``
        tokens (each conditioned on the token before it, the first on the prefix token)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        results = []
        for request in self._progress_over(requests, "loglikelihood_rolling", disable_tqdm):
            (text,) = request.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            total = sum(self.score_tokens(context, continuation, with_greedy=False).value
                        for context, continuation in windows)
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return results

    # -------------------------------------------------------------------------------------- several processes

    def all_gather(self, tensor):
        return tensor if self._world_size == 1 else self.accelerator.gather(tensor)

    def gather_object(self, obj, dst=0):
        if self._world_size == 1:
            return [obj]
        gathered = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj=obj, object_gather_list=gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self._world_size > 1:
            self.accelerator.wait_for_everyone()

    # --------------------------------------------------------------------------------------------- chat templates

    @property
    def tokenizer_name(self) -> str:
        return self.path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template ``--apply_chat_template [name]`` selects, as lm-eval's HF model (a name picks one of the
        tokenizer's named templates); :meth:`apply_chat_template` then renders with it."""
        if chat_template and not self.tokenizer.chat_template:
            raise ValueError(f"--apply_chat_template: the tokenizer of {self.path} has no chat template.")
        self._chat_template = TemplateLM.chat_template(self, chat_template)  # its selection, on our tokenizer
        return self._chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The selected chat template over ``chat_history`` as text (special tokens written out; the prompt is then
        tokenized without adding any), with ``chat_template_args`` as lm-eval's HF model."""
        template = self._chat_template or self.chat_template(True)
        return self.tokenizer.apply_chat_template(chat_history, chat_template=template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt,
                                                  **self.chat_template_args)


def request_generator(seed: int, context_ids: Sequence[int], continuation_ids: Sequence[int]) -> torch.Generator:
    """The CPU generator of one likelihood request's masks: seeded with ``seed`` and the request's token ids, so that
    a score depends on neither the order of the requests nor the process that runs them."""
    digest = hashlib.sha256(repr((int(seed), list(context_ids), list(continuation_ids))).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


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
