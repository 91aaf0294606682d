"""A Hugging Face Hub cache laid out on disk from local folders, so that Hub names (``org/name``) resolve offline
through huggingface_hub exactly as they do after a download.

The layout is huggingface_hub's own (``models--org--name/{blobs,snapshots/<commit>,refs/<revision>}``, files in
``snapshots`` as relative links to content-addressed ``blobs``); the folder names come from huggingface_hub's
``repo_folder_name``, and :func:`add_to_hub_cache` checks the result with its ``scan_cache_dir``, so a layout that
huggingface_hub would not read fails here, not in the test that uses it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name


def _commit_hash(files: dict[str, bytes]) -> str:
    """A 40-hex commit id, stable for the same files (what a Hub revision resolves to)."""
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
    return digest.hexdigest()


def add_to_hub_cache(cache_dir: str | Path, repo_id: str, folder: str | Path, repo_type: str = "model",
                     revisions: tuple[str, ...] = ("main",), overrides: dict[str, bytes] | None = None) -> str:
    """Write ``folder``'s files into the Hub cache ``cache_dir`` as repository ``repo_id`` (a ``repo_type``) at one
    commit, which the refs ``revisions`` point to; ``overrides`` replace or add files (by path in the repository).
    Returns the commit hash."""
    folder = Path(folder)
    files = {path.relative_to(folder).as_posix(): path.read_bytes()
             for path in sorted(folder.rglob("*")) if path.is_file() and "__pycache__" not in path.parts}
    files.update(overrides or {})
    commit = _commit_hash(files)
    repo = Path(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(content)
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(os.path.relpath(blob, target.parent))
    for revision in revisions:
        ref = repo / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    cached = {(r.repo_id, r.repo_type): r for r in scan_cache_dir(cache_dir).repos}
    entry = cached.get((repo_id, repo_type))
    if entry is None or commit not in {rev.commit_hash for rev in entry.revisions}:
        raise AssertionError(f"huggingface_hub does not read the cache written for {repo_id!r} in {cache_dir}")
    return commit
