"""Checksummed saves: a manifest of every file a checkpoint or model folder holds, written last and verified before
anything is loaded from it, so that silent corruption (a truncated file, a block of zeros) stops the run with one
clear error naming the file instead of training on damaged weights."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re

MANIFEST_NAME = "dllm_trl_manifest.json"
_CHUNK = 1 << 22
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "adapter_config.json", "pytorch_model*.bin", "adapter_model.bin")
"""The files of a saved model (``save_pretrained``) that :func:`write_manifest` records with ``only=MODEL_FILES``."""


class CheckpointError(RuntimeError):
    """A checkpoint or saved model folder that cannot be used as it is; the message names the file and the fix."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str, only: tuple[str, ...] | None = None) -> str:
    """Record the size and SHA-256 of every file below ``folder`` (the manifest itself excluded), or with ``only``
    of the files directly in ``folder`` whose name matches one of those patterns; returns the manifest's path."""
    files = {}
    for root, _, names in os.walk(folder):
        if only is not None and root != folder:
            continue
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative == MANIFEST_NAME or only is not None and not any(fnmatch.fnmatch(name, p) for p in only):
                continue
            files[relative] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    target = os.path.join(folder, MANIFEST_NAME)
    staging = target + ".tmp"
    with open(staging, "w") as handle:
        json.dump({"files": files}, handle, indent=1, sort_keys=True)
    os.replace(staging, target)
    return target


def verify_manifest(folder: str, advice: str = "") -> bool:
    """Check every file the manifest of ``folder`` lists (present, same size, same SHA-256).

    Returns ``False`` when the folder has no manifest (saved without one, or by another tool); raises
    :class:`CheckpointError` naming the first bad file, with ``advice`` (what to do instead) appended.
    """
    manifest_path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        return False
    try:
        with open(manifest_path) as handle:
            files = json.load(handle)["files"]
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{manifest_path}: the checksum manifest is unreadable ({error}).{advice}") from None
    for relative, expected in sorted(files.items()):
        path = os.path.join(folder, relative)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the manifest lists it).{advice}")
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes where {expected['bytes']} were saved (truncated or "
                                  f"overwritten).{advice}")
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: its contents changed since it was saved (SHA-256 mismatch: corrupted)."
                                  f"{advice}")
    return True


def check_readable(folder: str, advice: str = "") -> None:
    """Cheap structural checks of the files every checkpoint has, for folders saved without a manifest: the JSON files
    parse and each safetensors file has a readable header."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".json"):
            try:
                with open(path) as handle:
                    json.load(handle)
            except ValueError as error:
                raise CheckpointError(f"{path}: not valid JSON ({error}): the file is truncated or corrupted."
                                      f"{advice}") from None
        elif name.endswith(".safetensors"):
            from safetensors import safe_open

            try:
                with safe_open(path, framework="pt") as handle:
                    handle.keys()
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: unreadable safetensors file ({error}).{advice}") from None


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(run_dir: str) -> list[str]:
    """The finished ``checkpoint-N`` folders of ``run_dir``, oldest first (``.partial`` staging folders excluded)."""
    if not os.path.isdir(run_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(run_dir) if (m := _CHECKPOINT.match(name))
             and os.path.isdir(os.path.join(run_dir, name))]
    return [os.path.join(run_dir, name) for _, name in sorted(found)]
