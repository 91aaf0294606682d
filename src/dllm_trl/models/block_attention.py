"""Block-causal attention of block-diffusion LMs (SDAR / TraDo, Fast-dLLM v2; SPEC §7).

A block-diffusion LM attends causally across blocks of ``config.diffusion_block_size`` positions and
bidirectionally inside a block: position ``i`` in block ``b`` sees every position of blocks ``≤ b``. Blocks are
counted from the first column of the input, as in SDAR's and Fast-dLLM v2's own code (their reference decoders
run one unpadded sequence). Whoever pads a batch on the left therefore also pads each prompt to a multiple of the
block size (:func:`align_prompt`), so that every completion starts on a block boundary: the sampler, the scoring
passes and the packed forward all do, and a left-padded row then sees exactly the blocks it sees alone.

One rule builds every mask the library passes (the plain forward's, the sampler's cached steps', the packed
forward's): a token carries a block id and a *copy* id (0 for the sequence itself, ``s > 0`` for the ``s``-th
noisy copy of one block appended after it); a query sees a real key when the key is in the sequence and in an
earlier block, or in the query's own copy and block. For copy 0 that is "block ≤ the query's". Every query also
sees itself, so that padding rows are never empty (an all-masked sdpa row gives NaN).
"""

from __future__ import annotations

import torch


def block_causal_mask(
    key_padding_mask: torch.Tensor,
    key_blocks: torch.Tensor,
    query_blocks: torch.Tensor,
    query_columns: torch.Tensor,
    key_copies: torch.Tensor | None = None,
    query_copies: torch.Tensor | None = None,
    additive_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The ``(B, 1, Q, K)`` mask of the rule above.

    ``key_padding_mask`` (B, K): 1 = real key. ``key_blocks`` / ``key_copies`` (K,) or (B, K), ``query_blocks`` /
    ``query_copies`` (Q,) or (B, Q): block and copy ids (copies default to 0). ``query_columns`` (Q,) or (B, Q): the
    key index of each query itself. Boolean (True = attend) for sdpa, additive (0 / ``finfo.min``) in
    ``additive_dtype`` for eager attention.
    """
    batch, key_length = key_padding_mask.shape
    device = key_padding_mask.device

    def rows(x):  # (B, n) from (n,) or (B, n)
        return x.to(device).expand(batch, -1) if x.dim() == 1 else x.to(device)

    key_blocks, query_blocks, query_columns = rows(key_blocks), rows(query_blocks), rows(query_columns)
    k_block, q_block = key_blocks[:, None, :], query_blocks[:, :, None]
    if key_copies is None and query_copies is None:
        visible = k_block <= q_block
    else:
        k_copy = rows(key_copies if key_copies is not None else torch.zeros_like(key_blocks))[:, None, :]
        q_copy = rows(query_copies if query_copies is not None else torch.zeros_like(query_blocks))[:, :, None]
        visible = ((k_copy == 0) & (k_block < q_block)) | ((k_copy == q_copy) & (k_block == q_block))
    keep = visible & key_padding_mask.to(device=device, dtype=torch.bool)[:, None, :]
    keep |= torch.arange(key_length, device=device)[None, None, :] == query_columns[:, :, None]
    keep = keep.unsqueeze(1)
    if additive_dtype is None:
        return keep
    return torch.zeros(keep.shape, dtype=additive_dtype, device=device).masked_fill(
        ~keep, torch.finfo(additive_dtype).min
    )


def column_blocks(start: int, stop: int, block_size: int, device=None) -> torch.Tensor:
    """Block ids of input columns ``[start, stop)``."""
    return torch.arange(start, stop, device=device) // block_size


def prompt_padding(prompt_length: int, block_size: int | None) -> int:
    """Left padding that makes a prompt of ``prompt_length`` columns end on a block boundary (0 without blocks)."""
    return 0 if not block_size else -prompt_length % block_size


def align_prompt(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, block_size: int | None, fill_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ``(prompt_ids, prompt_mask)`` with ``fill_id`` / 0 to a multiple of ``block_size`` columns."""
    pad = prompt_padding(prompt_ids.shape[1], block_size)
    if pad == 0:
        return prompt_ids, prompt_mask
    rows = prompt_ids.shape[0]
    ids = torch.cat([prompt_ids.new_full((rows, pad), fill_id), prompt_ids], dim=1)
    mask = torch.cat([prompt_mask.new_zeros((rows, pad)), prompt_mask], dim=1)
    return ids, mask
