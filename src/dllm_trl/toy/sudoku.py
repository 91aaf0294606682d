"""The Sudoku toy task: fill a 4×4 Sudoku (``"1030 0400 0002 3000="`` → ``"1234 3412 2143 4321"``).

Why this task: it is one of the two small reasoning tasks the diffusion-LM RL papers benchmark on (d1, wd1, SPG,
ESPO: Sudoku 4×4 and Countdown); its answer is 16 cells, so a completion is 19 tokens (four rows of four digits,
single spaces between the rows) and a rollout commits them over many denoising steps, in an order the sampler
chooses (the given cells are easy, the blanks are not); and it is rule-checkable, so the reward needs no stored
answer and cannot be fooled by a near miss.

Grid: rows of 4 digits 1–4; every row, column and 2×2 box holds each digit once (288 grids). A puzzle is a grid
with some cells replaced by ``0``; every puzzle here has exactly one solution, with 6–12 blanks (see
:func:`sudoku_problems`). Prompt: the puzzle's four rows separated by spaces, then ``=``. The splits are fixed:
``"test"`` (200 puzzles, the held-out set), ``"validation"`` (200, used only to stop pre-training) and
``"train"`` (10,000), pairwise disjoint as puzzles (the solution grids necessarily repeat: there are only 288).
"""

from __future__ import annotations

import functools
import itertools
import random

from datasets import Dataset

from .task import completion_text

SIZE = 4
CELLS = SIZE * SIZE
DIGITS = "1234"
BLANK = "0"
SPLIT_SIZES = {"test": 200, "validation": 200, "train": 10_000}
SPLIT_SEED = 4321
BLANK_RANGE = (6, 12)
"""Blanks per puzzle: a target drawn uniformly in this range; cells are removed (in random order) while the
solution stays unique, so a puzzle can end with fewer blanks than its target when no cell can go."""


def _units() -> list[tuple[int, ...]]:
    """The 12 groups of cell indices that must hold 1–4 once each: 4 rows, 4 columns, 4 boxes."""
    rows = [tuple(range(r * SIZE, (r + 1) * SIZE)) for r in range(SIZE)]
    cols = [tuple(range(c, CELLS, SIZE)) for c in range(SIZE)]
    boxes = [
        tuple((br + dr) * SIZE + bc + dc for dr in (0, 1) for dc in (0, 1)) for br in (0, 2) for bc in (0, 2)
    ]
    return rows + cols + boxes


UNITS = _units()


@functools.cache
def all_grids() -> tuple[str, ...]:
    """Every solved 4×4 grid as a 16-character string (row-major), in lexicographic order (288 of them)."""
    rows = ["".join(p) for p in itertools.permutations(DIGITS)]
    grids = [""]
    for _ in range(SIZE):  # extend row by row, keeping only prefixes whose columns and boxes have no repeat
        grids = [g + row for g in grids for row in rows if _consistent(g + row)]
    return tuple(grids)


def _consistent(cells: str) -> bool:
    """No unit repeats a digit among the filled prefix ``cells`` (row-major)."""
    return all(
        len(seen) == len(set(seen)) for seen in ([cells[i] for i in unit if i < len(cells)] for unit in UNITS)
    )


def is_valid_grid(grid: str) -> bool:
    """``grid`` is 16 characters from ``1234`` and every row, column and box holds each digit once."""
    return len(grid) == CELLS and set(grid) <= set(DIGITS) and all(
        len({grid[i] for i in unit}) == SIZE for unit in UNITS
    )


@functools.cache
def _grids_with() -> tuple[tuple[int, ...], ...]:
    """``_grids_with()[cell][d]``: bit set over :func:`all_grids` of the grids holding digit ``d+1`` at ``cell``."""
    grids = all_grids()
    table = []
    for cell in range(CELLS):
        masks = [0] * SIZE
        for n, grid in enumerate(grids):
            masks[int(grid[cell]) - 1] |= 1 << n
        table.append(tuple(masks))
    return tuple(table)


def _solutions(puzzle: str) -> int:
    """Bit set over :func:`all_grids` of the grids that agree with the puzzle's given (non-``0``) cells."""
    table = _grids_with()
    candidates = (1 << len(all_grids())) - 1
    for cell, value in enumerate(puzzle):
        if value != BLANK:
            candidates &= table[cell][int(value) - 1]
    return candidates


def count_solutions(puzzle: str) -> int:
    """Number of grids that agree with the puzzle's given (non-``0``) cells."""
    return bin(_solutions(puzzle)).count("1")


def make_puzzle(grid: str, rng: random.Random, blanks: int) -> str:
    """Blank up to ``blanks`` cells of ``grid`` in random order, skipping any whose removal breaks uniqueness."""
    puzzle = list(grid)
    order = list(range(CELLS))
    rng.shuffle(order)
    removed = 0
    for cell in order:
        if removed == blanks:
            break
        kept = puzzle[cell]
        puzzle[cell] = BLANK
        if count_solutions("".join(puzzle)) == 1:
            removed += 1
        else:
            puzzle[cell] = kept
    return "".join(puzzle)


def format_grid(cells: str) -> str:
    """``"1234341221434321"`` → ``"1234 3412 2143 4321"`` (rows separated by single spaces)."""
    return " ".join(cells[r * SIZE : (r + 1) * SIZE] for r in range(SIZE))


def sudoku_prompt(puzzle: str) -> str:
    """The prompt of a puzzle: its rows, blanks as ``0``, then ``=``."""
    return format_grid(puzzle) + "="


@functools.cache
def _split_puzzles() -> dict[str, tuple[tuple[str, str], ...]]:
    rng = random.Random(SPLIT_SEED)
    grids = all_grids()
    seen, splits = set(), {}
    for split in ("test", "validation", "train"):
        chosen = []
        while len(chosen) < SPLIT_SIZES[split]:
            grid = rng.choice(grids)
            puzzle = make_puzzle(grid, rng, rng.randint(*BLANK_RANGE))
            if puzzle.count(BLANK) >= BLANK_RANGE[0] and puzzle not in seen:
                seen.add(puzzle)
                chosen.append((puzzle, grid))
        splits[split] = tuple(chosen)
    return splits


def sudoku_puzzles(split: str = "train") -> list[tuple[str, str]]:
    """``(puzzle, solution)`` pairs of a split as 16-character strings, in a fixed order."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"split={split!r}: expected one of {tuple(SPLIT_SIZES)}.")
    return list(_split_puzzles()[split])


def sudoku_problems(split: str = "train", max_blanks: int | None = None) -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs of a split, e.g. ``("1030 0400 0002 3000=", "1234 3412 2143 4321")``; with
    ``max_blanks``, only the puzzles with at most that many blanks (in the split's order)."""
    return [(sudoku_prompt(puzzle), format_grid(solution)) for puzzle, solution in sudoku_puzzles(split)
            if max_blanks is None or puzzle.count(BLANK) <= max_blanks]


RELABELLING = str.maketrans("12", "21")
"""The noisy teacher's systematic error: digits 1 and 2 exchanged everywhere in its answer, givens included."""


def noisy_teacher_problems(problems: list[tuple[str, str]], relabel_fraction: float, seed: int = 7):
    """``problems`` (``(prompt, answer)`` pairs) as written by a teacher that, on a random ``relabel_fraction`` of
    them (drawn with ``random.Random(seed)``), exchanges the digits 1 and 2 throughout its answer. A relabelled answer
    is a valid grid that changes the givens, so the Sudoku rewards score it 0: pre-training on these gives a policy
    that samples both conventions, the error that RL with the verifier can remove (the main job's checkpoint)."""
    if not 0.0 <= relabel_fraction <= 1.0:
        raise ValueError(f"relabel_fraction={relabel_fraction}: expected a share in [0, 1].")
    rng = random.Random(seed)
    return [(prompt, answer.translate(RELABELLING) if rng.random() < relabel_fraction else answer)
            for prompt, answer in problems]


def sudoku_up_to_relabelling_reward(completions, puzzle, **kwargs) -> list[float]:
    """1.0 where the completion, or the completion with 1 and 2 exchanged, solves its puzzle: the competence of a
    policy trained on :func:`noisy_teacher_problems`, whichever convention it writes in."""
    plain = sudoku_reward(completions, puzzle)
    relabelled = sudoku_reward([completion_text(c).translate(RELABELLING) for c in completions], puzzle)
    return [max(a, b) for a, b in zip(plain, relabelled, strict=True)]


def sudoku_dataset(split: str = "train", size: int | None = None, conversational: bool = False) -> Dataset:
    """The task as a `datasets.Dataset`: TRL's ``prompt`` column, ``puzzle`` (what the reward reads) and ``answer``
    (the unique solution, formatted as a completion; for display and pre-training only).

    ``conversational=True`` gives one-turn chat prompts; ``size`` keeps the first ``size`` rows of the split.
    """
    pairs = sudoku_puzzles(split)
    if size is not None:
        if size < 0 or size > len(pairs):
            raise ValueError(f"size={size}: the {split!r} split has {len(pairs)} puzzles.")
        pairs = pairs[:size]
    prompts = [sudoku_prompt(p) for p, _ in pairs]
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict(
        {"prompt": prompts, "puzzle": [p for p, _ in pairs], "answer": [format_grid(s) for _, s in pairs]}
    )


def parse_grid(text: str) -> str | None:
    """The 16 cells of a completion written as four whitespace-separated rows of four digits, else ``None``."""
    rows = text.split()
    if len(rows) != SIZE or any(len(row) != SIZE for row in rows):
        return None
    return "".join(rows)


def solves(puzzle: str, completion) -> bool:
    """The completion (text or chat messages, cut at the first special token) is a valid grid keeping the
    puzzle's given cells."""
    grid = parse_grid(completion_text(completion))
    if grid is None or not is_valid_grid(grid):
        return False
    return all(given in (BLANK, cell) for given, cell in zip(puzzle, grid, strict=True))


def solve(puzzle: str) -> str:
    """The unique solution of ``puzzle`` (a ``ValueError`` if it has none or several)."""
    candidates = _solutions(puzzle)
    if bin(candidates).count("1") != 1:
        raise ValueError(f"puzzle {puzzle!r} has {bin(candidates).count('1')} solutions, not one.")
    return all_grids()[candidates.bit_length() - 1]


def sudoku_reward(completions, puzzle, **kwargs) -> list[float]:
    """TRL reward function: 1.0 where the completion solves its puzzle (rule check, no stored answer), else 0.0."""
    return [float(solves(p, c)) for c, p in zip(completions, puzzle, strict=True)]


def sudoku_cell_reward(completions, puzzle, **kwargs) -> list[float]:
    """TRL reward function with partial credit (d1's Sudoku reward): the share of the puzzle's blank cells that the
    completion fills with the solution's digit; 0.0 unless the completion is a grid (four rows of four digits 1–4)
    that keeps every given cell. 1.0 exactly when the completion solves the puzzle. Puzzles must be unique."""
    scores = []
    for c, p in zip(completions, puzzle, strict=True):
        grid = parse_grid(completion_text(c))
        blanks = [i for i, given in enumerate(p) if given == BLANK]
        if grid is None or not set(grid) <= set(DIGITS) or any(g not in (BLANK, x) for g, x in zip(p, grid)):
            scores.append(0.0)
        elif not blanks:
            scores.append(float(is_valid_grid(grid)))
        else:
            solution = solve(p)
            scores.append(sum(grid[i] == solution[i] for i in blanks) / len(blanks))
    return scores
