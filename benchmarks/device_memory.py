"""Timing and memory helpers shared by the GPU benchmarks (``gpu_suite.py`` and the scripts it runs)."""

from __future__ import annotations

import contextlib

import torch


def sync(device):
    """Wait for ``device``'s queued work (CUDA), so that a wall-clock reading covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def peak_gib(device, into: dict):
    """Peak allocated device memory inside the block (GiB), written to ``into["peak"]`` (NaN on CPU)."""
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    yield
    into["peak"] = torch.cuda.max_memory_allocated() / 2**30 if is_cuda else float("nan")
