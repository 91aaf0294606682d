"""Many sampled states of a block-diffusion completion in one forward (SPEC §7), as tensor functions.

A state ``o_t`` of a block-diffusion rollout differs from the clean completion only inside the block being decoded at
step ``t`` (blocks are decoded in order, so the earlier ones are finished; the later ones are masked but invisible to
it under block-causal attention). So one forward over

    prompt ⊕ clean completion ⊕ a noisy copy of each state's block

scores every state at once, exactly: each copy keeps its block's positions and sees the clean blocks before it and
itself; the clean part sees the clean part only (block-causally). It is the layout of block-diffusion training
(Fast-dLLM v2's and BD3-LM's ``x_t ⊕ x_0`` mask, TraceRL's packed states), with one copy per sampled state.

Layout of one packed row (``B`` the attention block size, every width a multiple of it):

* columns ``[0, P)``: the prompt, left-padded to a block boundary (:func:`~dllm_trl.models.align_prompt`);
* columns ``[P, P + C)``: the first ``C / B`` blocks of the clean completion (as far as the latest state needs);
* columns ``[P + C + j B, P + C + (j + 1) B)``: copy ``j``, block ``n_j`` of state ``j``, at position ids
  ``P + n_j B + [0, B)``.

The targets of a state are read inside its block only (:func:`in_state_block`): that is all a block model's state
predicts that its rollout step saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.block_attention import align_prompt, block_causal_mask
from .rldf_terms import INVALID_STEP


def state_blocks(commit_step: torch.Tensor, steps: torch.Tensor, block_size: int) -> torch.Tensor:
    """(R, m): the block decoded at each sampled step ``steps`` (R, m) — the block of the tokens committed at it —
    or −1 where the step is padding (or committed nothing)."""
    hit = commit_step.unsqueeze(1) == steps.unsqueeze(-1)  # (R, m, G)
    block = hit.int().argmax(-1) // block_size
    return torch.where(hit.any(-1) & (steps != INVALID_STEP), block, -1)


def in_state_block(commit_step: torch.Tensor, step: torch.Tensor, block_size: int) -> torch.Tensor:
    """(R, G) bool: the completion positions in the block decoded at ``step`` (R,), one state per row."""
    block = state_blocks(commit_step, step.view(-1, 1), block_size)  # (R, 1)
    positions = torch.arange(commit_step.shape[1], device=commit_step.device) // block_size
    return positions.unsqueeze(0) == block


def states_per_forward(prompt_width: int, gen_length: int, block_size: int) -> int:
    """How many states one packed forward holds: their copies add at most one state's own length
    (``prompt + completion``), so a packed forward is never more than twice as long as scoring one state."""
    return max(1, (prompt_width + gen_length) // block_size)


@dataclass
class PackedStates:
    """One packed forward: ``input_ids`` / ``position_ids`` (R, N), ``attention_mask`` (R, 1, N, N) (boolean, or
    additive when built with ``additive_dtype``), the first copy's column ``copy_start``, the prompt width
    ``prompt_width``, each copy's block ``copy_blocks`` (R, m) and the block size."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    copy_start: int
    prompt_width: int
    copy_blocks: torch.Tensor
    block_size: int


def pack_block_copies(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    clean_ids: torch.Tensor,
    copy_ids: torch.Tensor,
    copy_blocks: torch.Tensor,
    copy_real: torch.Tensor,
    block_size: int,
    fill_id: int,
    additive_dtype: torch.dtype | None = None,
) -> PackedStates:
    """Pack ``prompt ⊕ clean_ids ⊕ copies`` (the layout of the module docstring).

    ``clean_ids`` (R, C): the clean completion's first blocks. ``copy_ids`` (R, m, B): the noisy copies, copy ``j``
    of row ``r`` standing for block ``copy_blocks[r, j]`` (< C / B); ``copy_real`` (R, m): whether that copy exists
    (padding copies are hidden from every other token). ``fill_id`` fills the prompt's alignment padding.
    """
    rows, copies = copy_blocks.shape
    clean_width = clean_ids.shape[1]
    if clean_width % block_size or copy_ids.shape[-1] != block_size:
        raise ValueError(f"clean_ids width {clean_width} and copies of {copy_ids.shape[-1]} must be whole blocks of {block_size}.")
    prompt_ids, prompt_mask = align_prompt(prompt_ids, prompt_mask, block_size, fill_id)
    prompt_width = prompt_ids.shape[1]
    device = prompt_ids.device
    canvas = prompt_width + clean_width
    within = torch.arange(block_size, device=device)
    copy_blocks = copy_blocks.clamp_min(0)
    input_ids = torch.cat([prompt_ids, clean_ids, copy_ids.reshape(rows, -1)], dim=1)
    copy_positions = prompt_width + copy_blocks.unsqueeze(-1) * block_size + within  # (R, m, B)
    position_ids = torch.cat([torch.arange(canvas, device=device).expand(rows, canvas), copy_positions.reshape(rows, -1)], 1)
    # A copy's tokens carry their block's position ids, so block ids follow from the position ids.
    blocks = position_ids // block_size
    copy_index = torch.arange(1, copies + 1, device=device).repeat_interleave(block_size)
    copy_ids_of_columns = torch.cat([torch.zeros(canvas, dtype=torch.long, device=device), copy_index])
    real = torch.cat([
        prompt_mask.bool(),
        torch.ones(rows, clean_width, dtype=torch.bool, device=device),
        copy_real.bool().repeat_interleave(block_size, dim=1),
    ], dim=1)
    columns = torch.arange(input_ids.shape[1], device=device)
    mask = block_causal_mask(real, blocks, blocks, columns, copy_ids_of_columns, copy_ids_of_columns, additive_dtype)
    return PackedStates(input_ids, position_ids, mask, canvas, prompt_width, copy_blocks, block_size)


def pack_sampled_states(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rollout_ids: torch.Tensor,
    commit_step: torch.Tensor,
    steps: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    additive_dtype: torch.dtype | None = None,
) -> PackedStates:
    """Pack the states ``o_t`` of the sampled steps ``steps`` (R, m) (``INVALID_STEP`` = padding) of each row: copy
    ``j`` is block ``n_j`` of ``o_{t_j}`` (positions committed at ``t_j`` or later masked), the clean part reaches
    the latest ``n_j`` of the batch."""
    blocks = state_blocks(commit_step, steps, block_size)
    real = blocks >= 0
    clean_width = int(blocks.max().clamp_min(0)) * block_size if blocks.numel() else 0  # one host sync
    positions = blocks.clamp_min(0).unsqueeze(-1) * block_size + torch.arange(block_size, device=steps.device)
    rows = torch.arange(rollout_ids.shape[0], device=steps.device).view(-1, 1, 1)
    tokens, committed_at = rollout_ids[rows, positions], commit_step[rows, positions]  # (R, m, B)
    noisy = torch.where(committed_at >= steps.unsqueeze(-1), torch.full_like(tokens, mask_token_id), tokens)
    return pack_block_copies(
        prompt_ids, prompt_mask, rollout_ids[:, :clean_width], noisy, blocks, real, block_size, mask_token_id,
        additive_dtype,
    )


def packed_read_positions(
    packed: PackedStates, read_mask: torch.Tensor, shift: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Where to read the prediction of each completion position ``i`` of state ``j`` with ``read_mask[r, j, i]``
    (R, m, G): ``(rows, columns)`` in the packed forward and the ``(r, j, i)`` they stand for.

    The output at copy column ``P + C + j B + (i − n_j B)`` predicts ``i`` (with a logit shift the column before; the
    block's first position is then predicted from the last column before the block, in the clean part).
    """
    block_size = packed.block_size
    block_of = torch.arange(read_mask.shape[-1], device=read_mask.device) // block_size
    outside = read_mask & (block_of != packed.copy_blocks.unsqueeze(-1))
    if outside.any():
        raise ValueError("read_mask selects positions outside their state's block: a packed forward scores a "
                         "block-diffusion state inside the block it decodes only (see in_state_block).")
    r, j, i = read_mask.nonzero(as_tuple=True)
    offset = i - packed.copy_blocks[r, j] * block_size
    columns = packed.copy_start + j * block_size + offset - shift
    if shift:
        first = offset == 0
        columns = torch.where(first, packed.prompt_width + packed.copy_blocks[r, j] * block_size - 1, columns)
    return r, columns, (r, j, i)
