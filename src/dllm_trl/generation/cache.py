"""The sampler's KV caches: keys and values of every canvas position, in canvas order, written in place (SPEC §1.2,
§7).

:class:`CanvasCache` (bidirectional models): a block's first step runs the whole canvas and its keys/values become
the cache as they are (no copy). Every later step of the block feeds only its window (the block, and for a prefix
cache everything after it); each layer writes the window's keys/values over their own slots and attends to the
whole canvas. So a step moves only the window's bytes, keys stay in canvas order (one key mask serves every call),
and the positions outside the window keep the keys of the block's first step — the Fast-dLLM approximation.

:class:`BlockCache` (block-diffusion models): the same canvas-order slots, but a call attends only to the keys up
to the end of what it feeds. Nothing after the current block is visible to a block-causal model, and the keys of a
finished block never change, so the cache is exact: each finished block is written once (by the first step of the
next block) and read by every later step.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _CanvasLayer(CacheLayerMixin):
    """One layer's post-RoPE keys and values ``(B, kv_heads, P+G, head_dim)``."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = key_states, value_states
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError(f"A {type(self).__name__} is written through its cache's update, which knows the window.")

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length(), 0


class CanvasCache(Cache):
    """Keys/values of a canvas of ``canvas_length`` positions for each of ``num_layers`` layers, in canvas order.

    A forward that feeds the whole canvas (the block's first step) replaces them; a forward that feeds a window
    of ``q`` positions writes them at canvas positions ``[window_start, window_start + q)`` (set it once per
    block). Either way the layer attends to all ``canvas_length`` keys, so the attention mask covers the whole
    canvas.
    """

    layer_class = _CanvasLayer

    def __init__(self, num_layers: int, canvas_length: int):
        super().__init__(layers=[self.layer_class() for _ in range(num_layers)])
        self.canvas_length = canvas_length
        self.window_start = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        fed = key_states.shape[-2]
        if fed == self.canvas_length:
            layer.lazy_initialization(key_states, value_states)
        elif not layer.is_initialized:
            raise RuntimeError("A CanvasCache is filled by a forward over the whole canvas before any window is fed.")
        else:
            window = slice(self.window_start, self.window_start + fed)
            layer.keys[..., window, :] = key_states
            layer.values[..., window, :] = value_states
        return layer.keys, layer.values


def cache_keyword(module: torch.nn.Module) -> str:
    """The forward's name for the cache: ``cache`` on newer transformers (where ``past_key_values`` is
    deprecated), ``past_key_values`` before."""
    return _cache_keyword(type(module))


@functools.cache
def _cache_keyword(module_class: type) -> str:
    return "cache" if "cache" in inspect.signature(module_class.forward).parameters else "past_key_values"


class _BlockLayer(_CanvasLayer):
    """One layer's post-RoPE keys and values over the canvas ``(B, kv_heads, P+G, head_dim)``, allocated at the
    first write."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, canvas_length: int) -> None:
        shape = (*key_states.shape[:-2], canvas_length, key_states.shape[-1])
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros((*shape[:-1], value_states.shape[-1]))
        self.is_initialized = True


class BlockCache(CanvasCache):
    """Keys/values of a canvas of ``canvas_length`` positions for each of ``num_layers`` layers, in canvas order.

    A forward that feeds ``q`` positions writes them at canvas positions ``[window_start, window_start + q)`` (set
    it before each call) and attends to the keys ``[0, window_start + q)``: the cached blocks before the window and
    the window itself, so its attention mask covers those keys only.
    """

    layer_class = _BlockLayer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states, self.canvas_length)
        end = self.window_start + key_states.shape[-2]
        layer.keys[..., self.window_start : end, :] = key_states
        layer.values[..., self.window_start : end, :] = value_states
        return layer.keys[..., :end, :], layer.values[..., :end, :]
