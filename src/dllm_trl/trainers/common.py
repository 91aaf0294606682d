"""What every trainer of the package does the same way at its hooks: the KL reference, up-front input checks,
quieting TRL's use of transformers' old checkpointing names, logging summed metrics, and safe checkpoints and
rewards (:class:`SafeRunMixin`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import signal
import sys
import threading
import warnings

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import rotate_checkpoints
from trl.trainer.utils import disable_dropout_in_model

from .._console import warn_once
from ..models.bidirectional import diffusion_block_size
from ..models.engines import (
    broadcast_from_main,
    check_launch,
    is_partitioned,
    model_config,
    prepare_frozen_model,
    unwrap_model,
    uses_peft,
    vocab_size,
)
from ..models.integrity import (
    MANIFEST_NAME,
    MODEL_FILES,
    CheckpointError,
    check_readable,
    checkpoints,
    verify_manifest,
    write_manifest,
)
from ..families import family_of, load_diffusion_model
from .safe_runs import (
    OutputDirInUseError,
    TrainingInterrupted,
    acquire_output_dir,
    check_resume,
    checking_reward_function,
    explain_failed_save,
    model_name_of,
    release_output_dir,
    set_aside_later_checkpoints,
    write_run_record,
)


def reference_copy(model, load=None):
    """A frozen copy of the policy as it is now, before PEFT wraps it.

    A deep copy, except when DeepSpeed ZeRO-3 partitioned the weights at load (``zero3_init_flag``): no process holds
    them whole, so the reference is loaded again from the policy's checkpoint (partitioned the same way) by
    ``load(path, **from_pretrained_kwargs)`` — :func:`~dllm_trl.load_diffusion_model` by default.
    """
    if not is_partitioned(model):
        return copy.deepcopy(model)
    base = unwrap_model(model)
    path = getattr(base, "name_or_path", "") or ""
    if not path:
        raise ValueError(
            "DeepSpeed ZeRO-3 partitioned the policy's weights at load (zero3_init_flag: true) and the model has no "
            "checkpoint path to load the KL reference from. Pass `model=` as a checkpoint path (or a model loaded with "
            "`load_diffusion_model(path)`), set `beta=0.0`, or set `zero3_init_flag: false` in the accelerate config."
        )
    config = base.config
    from_pretrained_kwargs = dict(dtype=base.dtype, attn_implementation=config._attn_implementation)
    if load is None:
        properties = {}  # a model without a mask token (DiffusionGemma) is loaded as its checkpoint says
        if getattr(config, "mask_token_id", None) is not None:
            properties = dict(mask_token_id=config.mask_token_id,
                              logit_shift=getattr(config, "diffusion_logit_shift", False),
                              sampling=getattr(config, "diffusion_sampling", None),
                              block_size=diffusion_block_size(config))
        return load_diffusion_model(path, **properties, **from_pretrained_kwargs)
    return load(path, **from_pretrained_kwargs)


def check_training_inputs(model, train_dataset, tokenizer) -> None:
    """Clear errors, up front, for inputs TRL would fail on deep inside (or silently train nothing with)."""
    if train_dataset is not None and hasattr(train_dataset, "__len__"):
        if len(train_dataset) == 0:
            raise ValueError("train_dataset is empty: there is nothing to train on.")
        columns = getattr(train_dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(
                f"train_dataset has no 'prompt' column (it has {columns}): rename the column that holds the prompts, "
                "e.g. dataset.rename_column('question', 'prompt'), or load it with dllm_trl.data.load_task_dataset."
            )
        if columns is not None:
            empty = [row for row, prompt in enumerate(train_dataset["prompt"]) if not _prompt_text(prompt).strip()]
            if empty:
                raise ValueError(
                    f"train_dataset has {len(empty)} empty or whitespace-only prompt(s), first at row {empty[0]}: a "
                    "completion of nothing teaches nothing and breaks the rollout. Remove them, e.g. "
                    "dataset.filter(lambda row: row['prompt'].strip()) for text prompts."
                )
    check_tokenizer_fits_model(model, tokenizer)
    tokenizer_mask = getattr(tokenizer, "mask_token_id", None)
    model_mask = getattr(getattr(model, "config", None), "mask_token_id", None)
    if tokenizer_mask is not None and model_mask is not None and tokenizer_mask != model_mask:
        raise ValueError(
            f"The tokenizer's mask token (id {tokenizer_mask}) is not the model's (config.mask_token_id={model_mask}): "
            "the model would be trained on a token it was never pre-trained to fill. Pass the checkpoint's tokenizer, or "
            "load the model with load_diffusion_model(..., mask_token_id=...)."
        )


def check_tokenizer_fits_model(model, tokenizer) -> None:
    """Refuse a tokenizer whose ids run past the model's vocabulary (an ``IndexError`` deep in the embedding later)."""
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    if text_tokenizer is None or not hasattr(text_tokenizer, "__len__") or model is None:
        return
    try:
        rows = vocab_size(model)
    except (TypeError, AttributeError):  # no transformers config: nothing to compare with
        return
    if len(text_tokenizer) > rows:
        raise ValueError(
            f"The tokenizer has {len(text_tokenizer)} tokens (ids up to {len(text_tokenizer) - 1}) but the model's "
            f"vocabulary has {rows} (config vocab_size={rows}): ids past it would index outside the embedding. Pass "
            "the checkpoint's own tokenizer, or grow the model to the tokenizer with "
            "model.resize_token_embeddings(len(tokenizer))."
        )


def check_prompt_positions(model, prompt_length: int, completion_length: int) -> None:
    """Refuse a batch whose longest prompt plus the completion runs past the model's ``max_position_embeddings``
    (or ``max_sequence_length``): positions the model never saw, trained on without a word otherwise."""
    config = model_config(model).get_text_config()
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "max_sequence_length", None)
    if limit is not None and prompt_length + completion_length > limit:
        raise ValueError(
            f"A {prompt_length}-token prompt + max_completion_length={completion_length} = "
            f"{prompt_length + completion_length} positions exceed the model's max_position_embeddings={limit}: the "
            "model never saw those positions. Drop or shorten the long prompts (e.g. dataset.filter on the tokenized "
            "length), or lower max_completion_length."
        )


PROMPT_LENGTH_CHECK_ROWS = 100_000
"""Datasets up to this many rows have every prompt measured at init (a larger one only at each batch)."""


def check_lengths_fit(model, completion_length: int, train_dataset=None, tokenizer=None) -> None:
    """At init, not at the first step: ``max_completion_length`` plus the longest prompt of ``train_dataset`` (as TRL
    tokenizes it, when the tokenizer is given and the dataset has at most :data:`PROMPT_LENGTH_CHECK_ROWS` rows; else
    plus one token) must fit the model's positions (:func:`check_prompt_positions`)."""
    from ..data.prompts import render_prompt

    longest = 1
    columns = getattr(train_dataset, "column_names", None) or ()
    if tokenizer is not None and "prompt" in columns and len(train_dataset) <= PROMPT_LENGTH_CHECK_ROWS:
        text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        try:
            texts = [render_prompt(text_tokenizer, prompt) for prompt in train_dataset["prompt"]]
        except ValueError:  # no chat template: TRL's own error comes at the first batch
            texts = []
        if texts:
            longest = max(len(ids) for ids in text_tokenizer(texts, add_special_tokens=False)["input_ids"])
    check_prompt_positions(model, longest, completion_length)


def diffusion_family(model, trainer_name: str):
    """The model's family (:func:`~dllm_trl.families.family_of`), refused unless it is a diffusion LM's."""
    family = family_of(model)
    if family.kind != "diffusion":
        raise ValueError(
            f"{trainer_name} trains diffusion LMs, and this {type(unwrap_model(model)).__name__} is a {family.kind} LM "
            f"(family {family.name!r}: no config.mask_token_id). Load it as a masked-diffusion LM with "
            "load_diffusion_model(path, mask_token_id=...), or train it as a causal LM with DPPOMaskTrainer / "
            "CausalDPPOMaskTrainer."
        )
    return family


def resolve_block_length(args, family, model) -> int:
    """``args.block_length``, or the family's own when it is ``None``; refused unless it divides
    ``max_completion_length``."""
    block_length = args.block_length
    if block_length is None:
        block_length = family.block_length(model, args.max_completion_length)
        if args.max_completion_length % block_length:
            raise ValueError(
                f"max_completion_length={args.max_completion_length} must be a multiple of the model's block length "
                f"{block_length} (block_length=None takes the {family.name} family's: its attention block or canvas): "
                f"set max_completion_length to a multiple of {block_length}."
            )
    return block_length


def with_family_lora_targets(kwargs: dict, family) -> dict:
    """``kwargs`` with a ``peft_config`` that names no ``target_modules`` given the family's
    (:attr:`~dllm_trl.families.ModelFamily.lora_target_modules`), on a copy; PEFT's own default otherwise."""
    peft_config = kwargs.get("peft_config")
    targets = family.lora_target_modules
    if peft_config is None or targets is None or getattr(peft_config, "target_modules", "unset") is not None:
        return kwargs
    return {**kwargs, "peft_config": dataclasses.replace(peft_config, target_modules=targets)}


def check_sampler_length(sampler_config, args) -> None:
    """A sampler handed to the trainer decodes its own ``gen_length``; TRL pads, scores and normalises completions to
    ``max_completion_length``. Refuse them differing, before anything is built."""
    gen_length = getattr(sampler_config, "gen_length", None)
    if gen_length is not None and gen_length != args.max_completion_length:
        raise ValueError(
            f"The sampler's gen_length={gen_length} differs from max_completion_length={args.max_completion_length}: "
            "the trainer pads, scores and normalises completions of max_completion_length tokens. Set both to the "
            "same length (for DiffusionGemma, a multiple of the model's canvas_length)."
        )


def _prompt_text(prompt) -> str:
    """The text of a prompt: a string, or the contents of a conversation's messages."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return "".join(_prompt_text(m.get("content", m.get("text", ""))) if isinstance(m, dict) else _prompt_text(m)
                       for m in prompt)
    return str(prompt) if prompt is not None else ""


def refuse_unsupported_kwargs(trainer_name: str, kwargs: dict) -> None:
    for unsupported in ("tools", "rollout_func", "environment_factory"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{unsupported}= is not supported by {trainer_name}.")


def init_with_reference(trainer, parent_init, model, args, load=None, **kwargs):
    """Run ``parent_init`` (a ``GRPOTrainer.__init__``) and return the KL reference it left for us to prepare.

    With PEFT, TRL's own semantics hold: the reference is the base model with adapters disabled, or — for a model
    that already carries an adapter (SFT then RL) — TRL's frozen copy ``"ref"`` of that adapter. Otherwise TRL would
    rebuild the reference with ``AutoModelForCausalLM`` from the policy's path, which cannot read LLaDA/Dream (nor
    an in-memory model): :func:`reference_copy` builds it instead, and ``beta`` is hidden from TRL meanwhile.
    """
    beta = args.beta
    reference = reference_copy(model, load) if beta != 0.0 and not uses_peft(model, kwargs.get("peft_config")) else None
    if reference is not None:
        args.beta = 0.0
    try:
        with old_checkpointing_names_quiet():  # PEFT's PeftModel reads is_gradient_checkpointing
            parent_init(model=model, args=args, **kwargs)
    finally:
        args.beta = beta
    trainer.beta = beta
    check_launch(trainer.accelerator)
    return reference


def prepare_reference(reference, accelerator, disable_dropout: bool):
    """The frozen KL reference, on every process, wrapped for the engine."""
    reference.requires_grad_(False)
    reference.eval()
    if disable_dropout:
        disable_dropout_in_model(reference)
    if not is_partitioned(reference):  # a partitioned reference was loaded shard by shard from the checkpoint
        broadcast_from_main(reference, accelerator)
    return prepare_frozen_model(reference, accelerator)


@contextlib.contextmanager
def old_checkpointing_names_quiet():
    """TRL (``unwrap_model_for_generation``, ``disable_gradient_checkpointing``: the rollout and the π_old pass) and
    PEFT (``PeftModel``) read and toggle gradient checkpointing through transformers' old names
    (``is_gradient_checkpointing``, ``gradient_checkpointing_disable/enable``), which transformers ≥ 5.24 deprecates
    with a FutureWarning on every step. What they do is right; only those warnings, raised inside TRL and PEFT, are
    dropped here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                                category=FutureWarning)
        yield


def log_metric_sums(trainer, mode: str, sums: dict) -> None:
    """Add ``name -> (numerator, denominator, skip_when_empty)`` over every process (one reduce) and append
    ``numerator / max(denominator, 1)`` to ``trainer._metrics[mode]`` (nothing where the denominator is 0 and the
    metric is skipped when empty: no value, not 0)."""
    if not sums:
        return
    flat = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=trainer.accelerator.device)
                        for num, den, _ in sums.values() for v in (num, den)])
    flat = trainer.accelerator.reduce(flat, reduction="sum")
    for n, (name, (_, _, skip_when_empty)) in enumerate(sums.items()):
        numerator, denominator = flat[2 * n], flat[2 * n + 1]
        if skip_when_empty and denominator.item() <= 0:
            continue
        trainer._metrics[mode][name].append((numerator / denominator.clamp_min(1)).item())


def log_metric_extremes(trainer, mode: str, extremes: dict) -> None:
    """Take ``name -> (value or None, "max" | "min")`` to its maximum / minimum over every process (one gather) and
    append it to ``trainer._metrics[mode]`` (nothing where no process has a value)."""
    if not extremes:
        return
    fill = {"max": -float("inf"), "min": float("inf")}
    flat = torch.stack([torch.as_tensor(fill[how] if value is None else value, dtype=torch.float32,
                                        device=trainer.accelerator.device) for value, how in extremes.values()])
    gathered = trainer.accelerator.gather(flat.unsqueeze(0)).view(-1, flat.numel())
    for n, (name, (_, how)) in enumerate(extremes.items()):
        value = getattr(gathered[:, n], how)()
        if torch.isfinite(value):
            trainer._metrics[mode][name].append(value.item())


class SafeRunMixin:
    """Mixed in before ``GRPOTrainer`` by every trainer of the package: nothing lost, nothing wrongly credited.

    * one run per ``output_dir``: ``train()`` holds an exclusive lock there (:func:`acquire_output_dir`) and refuses
      to start while another live process holds it; a ``.partial`` staging folder left by a killed save is removed;
    * checkpoints are written to a ``.partial`` staging folder, checksummed (``args.verify_checkpoints``) and renamed
      into place, so a process killed during a save never leaves a ``checkpoint-N`` that resume would pick up; a save
      that runs out of disk removes its staging folder and says so; a Hub push of a checkpoint uploads the renamed
      folder;
    * ``train(resume_from_checkpoint=...)`` takes a path or ``True`` (the newest checkpoint of ``output_dir``) and
      verifies the checkpoint before loading anything, naming the bad file and the previous checkpoint; a resume with
      another model or changed settings is refused (:func:`check_resume`), and resuming from an earlier checkpoint
      sets the later ones aside (:func:`set_aside_later_checkpoints`);
    * SIGTERM: the step under way finishes, a checkpoint is saved, and ``train()`` raises
      :class:`TrainingInterrupted` (a ``SystemExit`` with code 143) saying so;
    * each reward function's return is checked (a list or 1-D array of one number or ``None`` per completion);
      rewards a function could not give (``None``, NaN or ±inf) are counted per function
      (``rewards/<name>/unscorable_frac``), warned about once, or refused (``args.raise_on_unscorable_rewards``).
    """

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        run_dir = self.args.output_dir
        holds_lock = self.is_world_process_zero()
        self._on_main_then_everywhere(lambda: acquire_output_dir(run_dir) if holds_lock else None)
        try:
            if self.args.should_save:
                self._remove_stale_staging(run_dir)
            resume_from_checkpoint = self.resumed_from = self._checkpoint_to_resume(resume_from_checkpoint)
            if resume_from_checkpoint is not None:
                verify_checkpoint(resume_from_checkpoint, self.args.verify_checkpoints,
                                  needs_optimizer=not self.args.save_only_model)
                check_resume(resume_from_checkpoint, self.args, _model_name(self.model))
                if self.args.should_save:
                    self._set_aside_later_checkpoints(run_dir, resume_from_checkpoint)
            self.accelerator.wait_for_everyone()
            with self._stop_on_sigterm():
                result = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                       ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            if self._sigterm_stop_step is not None and self.state.global_step < self.state.max_steps:
                raise self._interrupted(run_dir)
            return result
        finally:
            if holds_lock:
                release_output_dir(run_dir)

    def _on_main_then_everywhere(self, action) -> None:
        """Run ``action`` (which may raise) where it is due, and raise its error on every process, not only there."""
        error = None
        try:
            action()
        except (OutputDirInUseError, OSError) as caught:
            error = caught
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            message = [None if error is None else str(error)]
            broadcast_object_list(message, from_process=0)
            if error is None and message[0] is not None:
                error = OutputDirInUseError(message[0])
        if error is not None:
            raise error

    def _checkpoint_to_resume(self, resume_from_checkpoint):
        if resume_from_checkpoint is True or str(resume_from_checkpoint).lower() == "true":
            found = checkpoints(self.args.output_dir)
            if not found:
                raise ValueError(f"resume_from_checkpoint=True: {self.args.output_dir} holds no checkpoint-N folder to "
                                 "resume from; train without it, or pass a checkpoint path.")
            return found[-1]
        if str(resume_from_checkpoint).lower() in ("false", "none", ""):
            return None
        return resume_from_checkpoint

    @staticmethod
    def _remove_stale_staging(run_dir: str) -> None:
        """A ``.partial`` folder at the start of a run was left by a save that was killed (this run holds the lock)."""
        staging = os.path.join(run_dir, STAGING_DIR)
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)  # another node's process may remove it too (shared disk)
            warnings.warn(f"Removed {staging}: the half-written checkpoint of a save that was killed.", stacklevel=3)

    @staticmethod
    def _set_aside_later_checkpoints(run_dir: str, resumed: str) -> None:
        moved = set_aside_later_checkpoints(run_dir, resumed, checkpoints(run_dir))
        if moved is not None:
            folder, names = moved
            warnings.warn(f"Resuming from {resumed}: set aside {', '.join(names)} (later checkpoints of the run "
                          f"abandoned there) in {folder}: kept, never picked by --resume_from_checkpoint true.",
                          stacklevel=3)

    resumed_from = None
    """The checkpoint the last ``train()`` resumed from (``True`` resolved to its path), or ``None``."""

    # -------------------------------------------------------------------------------------------------- SIGTERM
    _sigterm_received = False
    _sigterm_stop_step = None

    @contextlib.contextmanager
    def _stop_on_sigterm(self):
        """While training: a SIGTERM lets the step under way finish, then saves and stops (every process agrees)."""
        self._sigterm_received, self._sigterm_stop_step = False, None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        watchdog = []

        def note(signum, frame):
            if self._sigterm_received:  # a second SIGTERM: stop now
                exit_on_sigterm("a second SIGTERM came")
            self._sigterm_received = True
            grace = sigterm_grace_seconds()
            timer = threading.Timer(grace, exit_on_sigterm, (f"the step under way did not end within {grace:g} s",))
            timer.daemon = True
            timer.start()
            watchdog.append(timer)

        previous = signal.signal(signal.SIGTERM, note)
        callback = _StopOnSigterm(self)
        self.add_callback(callback)
        try:
            yield
        finally:
            for timer in watchdog:
                timer.cancel()
            self.remove_callback(callback)
            signal.signal(signal.SIGTERM, previous)

    def _sigterm_agreed(self) -> bool:
        received = torch.tensor(float(self._sigterm_received), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            received = self.accelerator.reduce(received, reduction="sum")
        return bool(received.item() > 0)

    def _interrupted(self, run_dir: str) -> TrainingInterrupted:
        step = self.state.global_step
        checkpoint = os.path.join(run_dir, f"checkpoint-{step}")
        saved = os.path.isdir(checkpoint)
        message = (f"SIGTERM: saved {checkpoint} and stopped at step {step} of {self.state.max_steps}. Resume with "
                   "--resume_from_checkpoint true (train(resume_from_checkpoint=True))." if saved else
                   f"SIGTERM: stopped at step {step} of {self.state.max_steps}; the checkpoint could not be saved.")
        if self.accelerator.is_main_process:
            print(message, file=sys.stderr, flush=True)
        return TrainingInterrupted(message, step, checkpoint if saved else None)

    # ---------------------------------------------------------------------------------------------- checkpoints
    _staging_save = False

    def _save_checkpoint(self, model, trial):
        run_dir = self._get_output_dir(trial=trial)
        staging_run = os.path.join(run_dir, STAGING_DIR)
        name = f"checkpoint-{self.state.global_step}"
        staged, final = os.path.join(staging_run, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.isdir(staged):  # left by a save that was killed
            shutil.rmtree(staged)
        self.accelerator.wait_for_everyone()
        previous = checkpoints(run_dir)
        self._get_output_dir = lambda trial=None: staging_run  # everything of this save goes to the staging folder
        self._staging_save, self._pending_pushes = True, []
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                write_run_record(staged, self.args, _model_name(self.model))
                if self.args.verify_checkpoints:
                    write_manifest(staged)
        except Exception as error:
            explanation = explain_failed_save(error, run_dir, name, previous[-1] if previous else None)
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rmdir(staging_run)
            if explanation is not None:
                raise OSError(explanation) from error
            raise
        finally:
            del self._get_output_dir
            self._staging_save = False
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(staged, final)
            with contextlib.suppress(OSError):
                os.rmdir(staging_run)
            best = self.state.best_model_checkpoint
            if best is not None and os.path.dirname(best) == staging_run:
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
        for pushed in self._pending_pushes:  # pushed from its final place, once renamed there
            super()._push_from_checkpoint(os.path.join(run_dir, os.path.relpath(pushed, staging_run)))
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The Trainer pushes a checkpoint from where it was written, the staging folder, which is renamed away at
        once: during a save, the push is made from the final folder after the rename (:meth:`_save_checkpoint`)."""
        if self._staging_save:
            self._pending_pushes.append(checkpoint_folder)
        else:
            super()._push_from_checkpoint(checkpoint_folder)

    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call=_internal_call)
        if not _internal_call and self.args.should_save and self.args.verify_checkpoints:
            write_manifest(output_dir or self.args.output_dir, only=MODEL_FILES)

    # ---------------------------------------------------------------------------------------------------- rewards
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        functions = self.reward_funcs
        self.reward_funcs = [f if isinstance(f, torch.nn.Module) else checking_reward_function(f, name)
                             for f, name in zip(functions, self.reward_func_names)]
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = functions
        rewards = rewards.masked_fill(torch.isinf(rewards), float("nan"))  # a reward model's ±inf logit, too
        self._gathered_rewards = rewards  # (every process's completions, reward functions)
        mode = "train" if self.model.training else "eval"
        unscorable = torch.isnan(rewards).float().mean(0).tolist()
        for name, fraction in zip(self.reward_func_names, unscorable):
            self._metrics[mode][f"rewards/{name}/unscorable_frac"].append(fraction)
            if fraction == 0:
                continue
            message = (f"The reward function {name!r} returned None, NaN or ±inf for {fraction:.0%} of the "
                       "completions: they get no advantage from it (TRL's rule).")
            if self.args.raise_on_unscorable_rewards:
                raise ValueError(f"{message} raise_on_unscorable_rewards=True makes this an error; make the function "
                                 "return a number for every completion, or set it to False.")
            warn_once(self, ("unscorable reward", name), message + " Logged as rewards/<name>/unscorable_frac; set "
                      "raise_on_unscorable_rewards=True to stop instead.")
        return rewards


SIGTERM_GRACE_SECONDS = 20.0
"""After a SIGTERM, how long the step under way (and the checkpoint save that follows) may take before the process
exits anyway (143, all threads' stacks on stderr): a process waiting in a collective on a partner that stopped
never reaches the end of its step. Below torchrun's 30 s between its SIGTERM and its SIGKILL; the environment
variable ``DLLM_TRL_SIGTERM_GRACE_SECONDS`` changes it (e.g. where a save takes longer and nothing kills)."""


def sigterm_grace_seconds() -> float:
    """:data:`SIGTERM_GRACE_SECONDS`, or ``DLLM_TRL_SIGTERM_GRACE_SECONDS`` when set (a clear error when not a
    number)."""
    value = os.environ.get("DLLM_TRL_SIGTERM_GRACE_SECONDS")
    if value is None:
        return SIGTERM_GRACE_SECONDS
    try:
        return float(value)
    except ValueError:
        message = f"DLLM_TRL_SIGTERM_GRACE_SECONDS={value!r} is not a number of seconds; set it to e.g. 20."
        raise ValueError(message) from None


def exit_on_sigterm(reason: str) -> None:
    """Leave now with 143 (128 + SIGTERM) after a SIGTERM that the run could not honour at a step's end: ``reason``
    and every thread's stack (where it waits) on stderr."""
    import faulthandler

    print(f"SIGTERM: {reason} (waiting in a collective on a process that stopped?); exiting with 143 without a "
          "checkpoint. Where each thread was:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(143)


class _StopOnSigterm(TrainerCallback):
    """At the end of each step: after a SIGTERM, save a checkpoint and stop (:meth:`SafeRunMixin._stop_on_sigterm`)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._sigterm_agreed():
            self.trainer._sigterm_stop_step = state.global_step
            control.should_save = True
            control.should_training_stop = True


def _model_name(model) -> str | None:
    try:
        return model_name_of(unwrap_model(model))
    except Exception:  # a model without a config has no name to compare
        return None


STAGING_DIR = ".partial"
"""Subfolder of ``output_dir`` where a checkpoint is written before it is renamed into place."""


def verify_checkpoint(path: str, with_manifest: bool = True, needs_optimizer: bool = True) -> None:
    """Refuse a checkpoint folder that cannot be resumed from, naming the file and the previous good checkpoint: a
    file the manifest lists that is missing or changed, unreadable JSON or safetensors, or a missing manifest (with
    ``with_manifest``), trainer state or optimizer state (with ``needs_optimizer``: resuming would silently start a
    fresh optimizer)."""
    run_dir = os.path.dirname(os.path.abspath(path))
    earlier = [c for c in checkpoints(run_dir) if _step(c) < _step(path)]

    def advice() -> str:
        for candidate in reversed(earlier):
            try:
                if with_manifest and verify_manifest(candidate) or not with_manifest:
                    return (f" The previous good checkpoint is {candidate}: resume from it "
                            f"(--resume_from_checkpoint {candidate}).")
            except CheckpointError:
                continue
        return f" There is no earlier good checkpoint in {run_dir}: train from the start."

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint folder.")
    names = os.listdir(path)
    if not names:
        raise CheckpointError(f"{path}: empty (a save was interrupted).{advice()}")
    try:
        if not (with_manifest and verify_manifest(path)):
            check_readable(path)
    except CheckpointError as error:
        raise CheckpointError(f"{error}{advice()}") from None
    missing = [MANIFEST_NAME] if with_manifest and MANIFEST_NAME not in names else []
    # optimizer.pt (DDP), optimizer.bin / optimizer_0 (FSDP), global_stepN/ (DeepSpeed)
    if needs_optimizer and not any(name.startswith(("optimizer", "global_step")) for name in names):
        missing.append("optimizer.pt")
    if "trainer_state.json" not in names:
        missing.append("trainer_state.json")
    if missing:
        raise CheckpointError(
            f"{path}: missing {', '.join(missing)}: resuming from it would start a fresh optimizer or schedule, or "
            f"load unverified files, without a word.{advice()} Or start a new run from its weights "
            f"(--model_name_or_path {path}) in another --output_dir."
        )


def _step(path: str) -> int:
    tail = os.path.basename(os.path.normpath(path)).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 1 << 62
