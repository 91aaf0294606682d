"""The pieces of :class:`~dllm_trl.trainers.common.SafeRunMixin` that guard a run against faults and bad input: one run
per ``output_dir`` (a lock), a clear error when a save runs out of disk, the settings a checkpoint was trained with
(refused when a resume changes them), checkpoints of an abandoned run set aside, a stop on SIGTERM that saves first,
and reward functions' returns checked. Only the standard library at import (a lock holder needs no more)."""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import shutil
import socket
import time
import warnings

LOCK_NAME = "_dllm_trl.lock"
"""File in ``output_dir`` that the run writing there holds an exclusive ``flock`` on."""
RUN_RECORD_NAME = "dllm_trl_run.json"
"""File in each checkpoint: the settings and model it was trained with (compared at resume)."""
ABANDONED_PREFIX = "_abandoned-after-"
"""``output_dir/_abandoned-after-checkpoint-N-<time>/``: later checkpoints of a run that was resumed from ``N`` (the
leading ``_`` keeps them, and the lock file, out of the Hub pushes of ``output_dir``)."""


class OutputDirInUseError(RuntimeError):
    """Another live process holds ``output_dir``; the message names it and the fix."""


class ResumeMismatchError(ValueError):
    """A resume whose settings or model differ from the checkpoint's; the message names each difference."""


class TrainingInterrupted(SystemExit):
    """Raised by ``train()`` after a SIGTERM: the checkpoint was saved and the run stopped early. A ``SystemExit``
    with code 143 (128 + SIGTERM), so an uncaught one ends a script as the signal would have, after the message was
    printed."""

    def __init__(self, message: str, step: int, checkpoint: str | None):
        super().__init__(143)
        self.message, self.step, self.checkpoint = message, step, checkpoint

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------------------------------------- lock
_held_locks: dict[str, list] = {}  # realpath of the lock file -> [open file, holders in this process]


def acquire_output_dir(output_dir: str) -> str:
    """Take ``output_dir`` for this process (an exclusive ``flock`` on its lock file, released when the process ends
    however it ends), or raise :class:`OutputDirInUseError` naming the process that holds it. Re-entrant within a
    process: each call needs one :func:`release_output_dir`. Returns the lock file's path."""
    import fcntl

    os.makedirs(output_dir, exist_ok=True)
    path = os.path.realpath(os.path.join(output_dir, LOCK_NAME))
    if path in _held_locks:
        _held_locks[path][1] += 1
        return path
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without flock
            handle.close()
            warnings.warn(f"output_dir {output_dir}: its filesystem cannot lock files ({error.strerror}), so nothing "
                          "stops a second run from writing there too; make sure only this run does.", stacklevel=2)
            _held_locks[path] = [open(os.devnull), 1]
            return path
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            handle.close()
            raise
        handle.seek(0)
        holder = handle.read().strip() or "a process that wrote no pid"
        handle.close()
        raise OutputDirInUseError(
            f"output_dir {output_dir} is in use by another run ({holder}): two runs there would interleave their "
            "logs and replace each other's checkpoints. Wait for that run to end (or stop it), or pass another "
            "--output_dir."
        ) from None
    if not _still_linked(handle, path):  # the holder we waited on removed the file as it released it: take anew
        handle.close()
        return acquire_output_dir(output_dir)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held_locks[path] = [handle, 1]
    return path


def release_output_dir(output_dir: str) -> None:
    """Undo one :func:`acquire_output_dir` of this process; the last one frees the folder."""
    path = os.path.realpath(os.path.join(output_dir, LOCK_NAME))
    held = _held_locks.get(path)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _held_locks[path]
        if _still_linked(held[0], path):  # a clean exit leaves no lock file behind; removed while still held, so a
            os.unlink(path)               # process that opened it meanwhile sees it gone and takes a new one
        held[0].close()  # closing the file releases the flock


def _still_linked(handle, path: str) -> bool:
    """``path`` still names the file ``handle`` has open (not removed or replaced since it was opened)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except (OSError, ValueError):  # removed, or the devnull stand-in of a filesystem without flock
        return False


# ----------------------------------------------------------------------------------------------------- disk full


def _errnos(error: BaseException) -> set[int]:
    """The errnos an error (and the errors it came from) carries, in its attributes or, as the safetensors and torch
    writers put them, only in its text."""
    found = set()
    while error is not None:
        if isinstance(error, OSError) and error.errno is not None:
            found.add(error.errno)
        text = str(error)
        for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            if f"os error {code})" in text or os.strerror(code) in text:
                found.add(code)
        error = error.__cause__ or error.__context__
    return found


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def explain_failed_save(error: BaseException, run_dir: str, name: str, previous: str | None) -> str | None:
    """The one-line cause and fix of a save of checkpoint ``name`` into ``run_dir`` that raised ``error``, when it is
    a lack of space (or a file-size limit); ``None`` for any other failure. torch's writer reports a full disk as
    ``RuntimeError: ... unexpected pos``, without the errno: then the free space left decides."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    needed = _folder_bytes(previous) if previous else 0
    codes = _errnos(error)
    kept = (f"The previous checkpoint {previous} is intact: resume from it (--resume_from_checkpoint true)."
            if previous else "No earlier checkpoint was saved.")
    if codes & {errno.ENOSPC, errno.EDQUOT} or (not codes and isinstance(error, RuntimeError)
                                                  and free < max(needed, 1 << 20)):
        return (f"Saving {name} to {run_dir} failed: the disk is full ({free / 2**20:.1f} MiB free; a checkpoint "
                f"takes about {needed / 2**20:.1f} MiB). Free space there (or lower save_total_limit, or use an "
                f"--output_dir on a larger disk). {kept}")
    if errno.EFBIG in codes:
        return (f"Saving {name} to {run_dir} failed: a file hit this process's file-size limit (`ulimit -f`). Raise "
                f"the limit. {kept}")
    return None


# ------------------------------------------------------------------------------------------- settings at resume
RESUMABLE_CHANGES = frozenset({
    # where and how often things are written, logged, reported, evaluated or pushed
    "output_dir", "logging_dir", "run_name", "overwrite_output_dir", "resume_from_checkpoint", "save_strategy",
    "save_steps", "save_total_limit", "save_on_each_node", "save_only_model", "save_safetensors", "logging_strategy",
    "logging_steps", "logging_first_step", "logging_nan_inf_filter", "log_level", "log_level_replica",
    "log_on_each_node", "log_completions", "num_completions_to_print", "log_unique_prompts", "report_to",
    "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "wandb_log_unique_prompts",
    "disable_tqdm", "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
    "hub_always_push", "hub_revision", "eval_strategy", "eval_steps", "eval_delay", "eval_on_start",
    "per_device_eval_batch_size", "eval_accumulation_steps", "prediction_loss_only", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "enable_jit_checkpoint", "verify_checkpoints",
    "raise_on_unscorable_rewards", "skip_memory_metrics", "include_num_input_tokens_seen",
    # how long to train: extending a run is a resume
    "max_steps", "num_train_epochs",
    # resources, not the training math
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "torch_empty_cache_steps", "ds3_gather_for_generation",
    "include_tokens_per_second", "eval_do_concat_batches", "dataloader_num_workers", "dataloader_prefetch_factor", "dataloader_pin_memory", "dataloader_persistent_workers",
    "ddp_timeout", "local_rank", "torch_compile", "torch_compile_backend", "torch_compile_mode",
})
"""Settings a resume may change: everything else a checkpoint recorded must be the same (see :func:`check_resume`)."""


def run_record(args, model_name: str | None) -> dict:
    """What :data:`RUN_RECORD_NAME` holds: the JSON-able settings of ``args`` and the model's name or path."""
    settings = json.loads(args.to_json_string())
    return {"model_name_or_path": model_name, "settings": settings}


def write_run_record(folder: str, args, model_name: str | None) -> None:
    with open(os.path.join(folder, RUN_RECORD_NAME), "w") as handle:
        json.dump(run_record(args, model_name), handle, indent=1, sort_keys=True)


def model_name_of(model) -> str | None:
    """The model's checkpoint name or path (``config._name_or_path``), made absolute when it is a local folder."""
    base = getattr(model, "base_model", model)
    config = getattr(getattr(base, "model", base), "config", None) or getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None) or None
    if name and os.path.isdir(name):
        name = os.path.realpath(name)
    return name


def check_resume(checkpoint: str, args, model_name: str | None) -> None:
    """Refuse a resume from ``checkpoint`` whose model or settings (other than :data:`RESUMABLE_CHANGES`) differ from
    the ones the checkpoint was trained with: the optimizer, scheduler and weights it restores would silently keep
    the old ones while the run reports the new. Checkpoints without a record (saved by another tool) pass."""
    path = os.path.join(checkpoint, RUN_RECORD_NAME)
    if not os.path.isfile(path):
        return
    with open(path) as handle:
        saved = json.load(handle)
    now = run_record(args, model_name)
    if saved.get("model_name_or_path") and model_name and saved["model_name_or_path"] != model_name:
        raise ResumeMismatchError(
            f"{checkpoint} was trained from the model {saved['model_name_or_path']}, not {model_name}: resuming would "
            "load the checkpoint's weights in place of the model you passed. Pass the checkpoint's model to resume, "
            "or start a new run (without --resume_from_checkpoint, in another --output_dir) from the model you want."
        )
    differ = [f"{name} {saved['settings'][name]!r} → {value!r}" for name, value in sorted(now["settings"].items())
              if name not in RESUMABLE_CHANGES and name in saved["settings"] and saved["settings"][name] != value]
    if differ:
        raise ResumeMismatchError(
            f"Resuming from {checkpoint} with settings that differ from the run that saved it: {'; '.join(differ)}. "
            "The checkpoint's optimizer and scheduler would keep the old values while the run reports the new. Resume "
            "with the saved values, or start a new run (in another --output_dir) from its weights: "
            f"--model_name_or_path {checkpoint}."
        )


def set_aside_later_checkpoints(run_dir: str, resumed: str, found: list[str]) -> tuple[str, list[str]] | None:
    """Move the checkpoints of ``run_dir`` past the one resumed from (``found``: every checkpoint folder there) into
    ``run_dir/_abandoned-after-<name>-<time>/``, so that ``--resume_from_checkpoint true`` later picks this run's
    newest checkpoint, not the abandoned run's. Returns (that folder, the names moved), or ``None``."""
    step = _step(resumed)
    later = [path for path in found if _step(path) > step and os.path.realpath(path) != os.path.realpath(resumed)]
    if not later:
        return None
    target = os.path.join(run_dir, f"{ABANDONED_PREFIX}{os.path.basename(os.path.normpath(resumed))}-"
                                   f"{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(target, exist_ok=True)
    names = [os.path.basename(path) for path in later]
    for path in later:
        os.replace(path, os.path.join(target, os.path.basename(path)))
    return target, names


def _step(path: str) -> int:
    tail = os.path.basename(os.path.normpath(path)).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 1 << 62


# ------------------------------------------------------------------------------------------------------ rewards
def checked_rewards(name: str, output, count: int) -> list:
    """The rewards a reward function ``name`` returned for ``count`` completions, as a list of floats or ``None``;
    a clear error for anything else (a 2-D tensor, strings, a bare number, a wrong length). ±inf becomes ``None``:
    a reward that is no number is no reward (TRL's rule for ``None`` / NaN), and it is counted as unscorable."""
    fix = f"Make {name!r} return a list (or 1-D tensor / array) of {count} numbers or None, one per completion."
    if isinstance(output, (str, bytes)) or isinstance(output, numbers.Number) or output is None:
        raise ValueError(f"The reward function {name!r} returned {type(output).__name__} {output!r} instead of one "
                         f"reward per completion. {fix}")
    if hasattr(output, "ndim") and hasattr(output, "tolist"):  # a tensor or array
        if output.ndim != 1:
            raise ValueError(f"The reward function {name!r} returned a {output.ndim}-D {type(output).__name__} of "
                             f"shape {tuple(output.shape)}. {fix}")
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise ValueError(f"The reward function {name!r} returned a {type(output).__name__}. {fix}")
    if len(output) != count:
        raise ValueError(f"The reward function {name!r} returned {len(output)} rewards for {count} completions. {fix}")
    import torch

    rewards = []
    for n, reward in enumerate(output):
        if isinstance(reward, torch.Tensor) and reward.numel() == 1:
            reward = reward.item()
        elif hasattr(reward, "item") and getattr(reward, "size", 2) == 1:  # a numpy scalar
            reward = reward.item()
        if reward is None:
            rewards.append(None)
        elif isinstance(reward, numbers.Real) and not isinstance(reward, (str, bytes)):
            rewards.append(float(reward) if math.isfinite(float(reward)) or math.isnan(float(reward)) else None)
        else:
            raise ValueError(f"The reward function {name!r} returned {type(reward).__name__} {reward!r} for "
                             f"completion {n}. {fix}")
    return rewards


def checking_reward_function(function, name: str):
    """``function`` wrapped so that its return goes through :func:`checked_rewards` (an async one stays async)."""
    from trl.trainer.utils import is_async_callable

    if is_async_callable(function):
        async def checked(*args, prompts, **kwargs):
            return checked_rewards(name, await function(*args, prompts=prompts, **kwargs), len(prompts))
    else:
        def checked(*args, prompts, **kwargs):
            try:
                rewards, error = checked_rewards(name, function(*args, prompts=prompts, **kwargs), len(prompts)), None
            except Exception as raised:
                rewards, error = None, raised
            stop_together(f"The reward function {name!r}", error)
            return rewards
    return checked


def stop_together(what: str, error: BaseException | None) -> None:
    """Raise on every process when ``what`` raised on any (``error``: this process's exception, or None), so that no
    process waits in a collective for one that has stopped: a ``RuntimeError`` naming the processes that failed and
    their errors, from this process's own. One small exchange between processes when there are several; a single
    process re-raises its own error unchanged."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [(rank, message) for rank, message in enumerate(everyone) if message is not None]
    if failed:
        where = "; ".join(f"process {rank}: {message}" for rank, message in failed)
        raise RuntimeError(f"{what} raised on {len(failed)} of {len(everyone)} processes ({where}); every process "
                           "stops here.") from error
