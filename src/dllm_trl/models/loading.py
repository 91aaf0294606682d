"""A checkpoint's ``config.json``, read without resolving its class (local folder or Hub name): what the model
families (:mod:`dllm_trl.families`) recognise a checkpoint by."""

from __future__ import annotations

import json
import os

from huggingface_hub import constants
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.utils import cached_file


HUB_KEYS = ("revision", "token", "cache_dir")
"""``from_pretrained`` keyword arguments that say where on the Hub a checkpoint's files come from."""


def hub_kwargs(from_pretrained_kwargs: dict) -> dict:
    """The Hub keywords (:data:`HUB_KEYS`) among ``from_pretrained`` keyword arguments: what reading a checkpoint's
    other files (``config.json``, safetensors shards) needs too."""
    return {key: from_pretrained_kwargs[key] for key in HUB_KEYS if key in from_pretrained_kwargs}


def is_hub_name(name_or_path: str) -> bool:
    """``name_or_path`` can name a Hub repository (``name`` or ``org/name``, as huggingface_hub validates ids) and
    does not start like a path (``/``, ``.``, ``~``). A relative folder ``a/b`` that does not exist is also a valid
    Hub name: the Hub (or its cache) is asked, and a miss names both readings."""
    if name_or_path.startswith((".", "~", "/", os.sep)) or (os.altsep and os.altsep in name_or_path):
        return False
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return False
    return True


def missing_checkpoint_error(name_or_path: str, filename: str, error: Exception | None = None) -> FileNotFoundError:
    """The error for a ``name_or_path`` that is neither a folder nor a Hub repository we can read ``filename`` of,
    worded for what was typed: a path, or a Hub name (with the cache and offline mode it was looked up under)."""
    if not is_hub_name(name_or_path):
        return FileNotFoundError(
            f"{name_or_path!r}: no such folder (from {os.getcwd()}). Pass an existing model folder, or a Hub name "
            "such as 'GSAI-ML/LLaDA-8B-Instruct'."
        )
    if constants.HF_HUB_OFFLINE:
        where = (f"nor in the local Hub cache ({constants.HF_HUB_CACHE}; HF_HUB_OFFLINE is set, so the Hub was not "
                 f"asked). Check the spelling, download it first (`hf download {name_or_path}`), or pass cache_dir=")
    else:
        where = ("nor a Hub repository that could be read. Check the spelling; a private or gated repository needs "
                 "token= (or `hf auth login`); without a connection, set HF_HUB_OFFLINE=1 to use the local cache")
    detail = f" ({type(error).__name__}: {str(error).splitlines()[0]})" if error is not None else ""
    return FileNotFoundError(
        f"{name_or_path!r} is neither a folder (from {os.getcwd()}) {where}. No {filename} found{detail}."
    )


def read_raw_config(name_or_path: str, **hub) -> dict:
    """The checkpoint's ``config.json`` as a dict (local folder or Hub name), without resolving its class."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{name_or_path!r} has no config.json.")
    elif not is_hub_name(name_or_path):
        raise missing_checkpoint_error(name_or_path, "config.json")
    else:
        try:
            path = cached_file(name_or_path, "config.json", **hub)
        except OSError as error:
            raise missing_checkpoint_error(name_or_path, "config.json", error) from error
    with open(path) as f:
        return json.load(f)
