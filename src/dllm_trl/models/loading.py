"""A checkpoint's ``config.json``, read without resolving its class (local folder or Hub name): what the model
families (:mod:`dllm_trl.families`) recognise a checkpoint by."""

from __future__ import annotations

import json
import os

from transformers.utils import cached_file


HUB_KEYS = ("revision", "token", "cache_dir")
"""``from_pretrained`` keyword arguments that say where on the Hub a checkpoint's files come from."""


def hub_kwargs(from_pretrained_kwargs: dict) -> dict:
    """The Hub keywords (:data:`HUB_KEYS`) among ``from_pretrained`` keyword arguments: what reading a checkpoint's
    other files (``config.json``, safetensors shards) needs too."""
    return {key: from_pretrained_kwargs[key] for key in HUB_KEYS if key in from_pretrained_kwargs}


def _looks_local(name_or_path: str) -> bool:
    """A path, not a Hub name (``org/name``): starts like one, or has more than one separator."""
    return name_or_path.startswith((".", "/", "~", os.sep)) or name_or_path.count("/") > 1 or os.sep in name_or_path


def read_raw_config(name_or_path: str, **hub) -> dict:
    """The checkpoint's ``config.json`` as a dict (local folder or hub name), without resolving its class."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{name_or_path!r} has no config.json.")
    elif _looks_local(name_or_path):
        raise FileNotFoundError(
            f"{name_or_path!r}: no such folder (from {os.getcwd()}). Pass an existing model folder, or a Hub name "
            "such as 'GSAI-ML/LLaDA-8B-Instruct'."
        )
    else:
        path = cached_file(name_or_path, "config.json", **hub)
    with open(path) as f:
        return json.load(f)
