"""Tests for the Sudoku toy task (dllm_trl.toy.sudoku): grids, puzzles, splits, verifier and reward."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_trl.toy import (
    SUDOKU_GEN_LENGTH,
    build_toy_tokenizer,
    evaluate_accuracy,
    evaluate_causal_accuracy,
    load_sudoku,
    load_sudoku_causal,
    load_sudoku_noisy_teacher,
    sudoku_generation_config,
    toy_assets_dir,
)
from dllm_trl.toy.tokenizer import MASK_TOKEN as MASK
from dllm_trl.toy.sudoku import (
    SPLIT_SIZES,
    all_grids,
    count_solutions,
    format_grid,
    is_valid_grid,
    noisy_teacher_problems,
    parse_grid,
    solve,
    solves,
    sudoku_cell_reward,
    sudoku_dataset,
    sudoku_problems,
    sudoku_puzzles,
    sudoku_reward,
    sudoku_up_to_relabelling_reward,
)


# ----------------------------------------------------------------------------------------- brute-force reference
def brute_force_grids() -> set[str]:
    """Every assignment of a permutation of 1–4 to each row, kept when columns and boxes have no repeat."""
    found = set()
    for rows in itertools.product(itertools.permutations("1234"), repeat=4):
        columns_ok = all(len({row[c] for row in rows}) == 4 for c in range(4))
        boxes_ok = all(
            len({rows[r][c] for r in (br, br + 1) for c in (bc, bc + 1)}) == 4 for br in (0, 2) for bc in (0, 2)
        )
        if columns_ok and boxes_ok:
            found.add("".join("".join(row) for row in rows))
    return found


def brute_force_solutions(puzzle: str, grids: set[str]) -> set[str]:
    """The complete grids (from :func:`brute_force_grids`) that keep every given cell of ``puzzle``."""
    return {g for g in grids if all(p in ("0", c) for p, c in zip(puzzle, g))}


@pytest.fixture(scope="module")
def grids():
    return brute_force_grids()


def test_all_grids_are_the_brute_force_grids(grids):
    assert len(all_grids()) == 288 and set(all_grids()) == grids
    assert list(all_grids()) == sorted(all_grids())
    assert all(is_valid_grid(g) for g in grids)


def random_puzzles(rng: random.Random, grids, count: int, max_blanks: int):
    """Puzzles with any number of solutions: a grid, a few cells blanked, sometimes a given cell changed."""
    grids = sorted(grids)
    for _ in range(count):
        cells = list(rng.choice(grids))
        for i in rng.sample(range(16), rng.randint(0, max_blanks)):
            cells[i] = "0"
        if rng.random() < 0.3:  # a changed given usually leaves no solution
            i = rng.choice([j for j in range(16) if cells[j] != "0"] or [0])
            cells[i] = rng.choice("1234")
        yield "".join(cells)


def test_verifier_agrees_with_brute_force_on_random_puzzles(grids):
    rng = random.Random(0)
    sorted_grids = sorted(grids)
    for puzzle in random_puzzles(rng, grids, count=500, max_blanks=12):
        expected = brute_force_solutions(puzzle, grids)
        assert count_solutions(puzzle) == len(expected)
        candidates = set(expected) | set(rng.sample(sorted_grids, 20))
        for grid in list(candidates):  # near misses: one cell changed
            i = rng.randrange(16)
            candidates.add(grid[:i] + rng.choice("12345") + grid[i + 1 :])
        for grid in candidates:
            assert solves(puzzle, format_grid(grid)) == (grid in expected), (puzzle, grid)


def test_shipped_puzzles_have_exactly_one_solution(grids):
    for split in SPLIT_SIZES:
        for puzzle, solution in sudoku_puzzles(split)[:100]:
            assert brute_force_solutions(puzzle, grids) == {solution}
        for puzzle, solution in sudoku_puzzles(split):
            assert count_solutions(puzzle) == 1 and solves(puzzle, format_grid(solution))
            assert 6 <= puzzle.count("0") <= 12


# ---------------------------------------------------------------------------------------------------- splits
def test_splits_are_deterministic_disjoint_and_sized():
    splits = {split: sudoku_puzzles(split) for split in SPLIT_SIZES}
    assert {s: len(p) for s, p in splits.items()} == SPLIT_SIZES
    seen = [{p for p, _ in pairs} for pairs in splits.values()]
    assert sum(len(s) for s in seen) == sum(SPLIT_SIZES.values())  # no puzzle twice, within or across splits
    assert sudoku_problems("test")[0] == (
        format_grid(splits["test"][0][0]) + "=", format_grid(splits["test"][0][1])
    )
    with pytest.raises(ValueError, match="split"):
        sudoku_puzzles("dev")


def test_max_blanks_keeps_exactly_the_easier_puzzles_in_order():
    everything = sudoku_problems("train")
    easy = sudoku_problems("train", max_blanks=8)
    assert easy == [(prompt, answer) for prompt, answer in everything if prompt.count("0") <= 8]
    assert 0 < len(easy) < len(everything) and sudoku_problems("train", max_blanks=12) == everything


def test_pretrain_config_refuses_bad_fields():
    from scripts.toy_pretraining import SudokuPretrainConfig

    with pytest.raises(ValueError, match="max_train_blanks"):
        SudokuPretrainConfig(max_train_blanks=0)
    with pytest.raises(ValueError, match="model_kind"):
        SudokuPretrainConfig(model_kind="rnn")
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="relabel_fraction"):
            SudokuPretrainConfig(relabel_fraction=bad)


def test_noisy_teacher_relabels_its_share_and_only_the_verifier_up_to_relabelling_credits_it():
    problems = sudoku_problems("train")[:2000]
    noisy = noisy_teacher_problems(problems, 0.5, seed=3)
    assert noisy == noisy_teacher_problems(problems, 0.5, seed=3) and noisy_teacher_problems(problems, 0.0) == problems
    relabelled = [(p, a) for (p, a), (_, clean) in zip(noisy, problems) if a != clean]
    assert [p for p, _ in noisy] == [p for p, _ in problems]
    assert 0.45 < len(relabelled) / len(problems) < 0.55  # the drawn share, give or take sampling noise
    by_prompt = dict(problems)
    for prompt, answer in relabelled:  # exactly 1 and 2 exchanged, everywhere (reference: per character)
        clean = by_prompt[prompt]
        assert answer == "".join({"1": "2", "2": "1"}.get(c, c) for c in clean)
    puzzles = [p[:-1].replace(" ", "") for p, _ in relabelled]
    answers = [a for _, a in relabelled]
    # a relabelled answer is a valid grid that breaks the givens: the task's rewards give it nothing ...
    assert all(is_valid_grid(a.replace(" ", "")) for a in answers)
    assert sudoku_reward(answers, puzzles) == [0.0] * len(answers)
    assert sudoku_cell_reward(answers, puzzles) == [0.0] * len(answers)
    # ... and the competence measure credits both conventions, but nothing else
    assert sudoku_up_to_relabelling_reward(answers, puzzles) == [1.0] * len(answers)
    clean_answers = [by_prompt[p] for p, _ in relabelled]
    assert sudoku_up_to_relabelling_reward(clean_answers, puzzles) == [1.0] * len(answers)
    other_relabelling = [a.translate(str.maketrans("34", "43")) for a in answers]
    wrong = [a[:-2] + a[-1] + a[-2] if a[-1] != a[-2] else a[:-1] + "5" for a in clean_answers]
    assert sudoku_up_to_relabelling_reward(other_relabelling + wrong, puzzles * 2) == [0.0] * (2 * len(answers))
    with pytest.raises(ValueError, match="relabel_fraction"):
        noisy_teacher_problems(problems, 1.5)


def test_dataset_formats_and_prompt_tokens():
    plain = sudoku_dataset("test", size=4)
    assert plain.column_names == ["prompt", "puzzle", "answer"] and len(plain) == 4
    prompt, answer = plain[0]["prompt"], plain[0]["answer"]
    assert len(prompt) == 20 and prompt.endswith("=") and len(answer) == 19
    chat = sudoku_dataset("test", size=4, conversational=True)
    assert chat[0]["prompt"] == [{"role": "user", "content": prompt}]
    tokenizer = build_toy_tokenizer()
    ids = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    assert len(ids) == 39 and tokenizer.unk_token_id not in ids  # one token per character, all known
    with pytest.raises(ValueError, match="size"):
        sudoku_dataset("test", size=201)


# ---------------------------------------------------------------------------------------------------- reward
def test_reward_scores_right_answers_one_and_wrong_ones_zero():
    puzzle, solution = sudoku_puzzles("test")[0]
    right = format_grid(solution)
    other_valid = next(g for g in all_grids() if g != solution)  # a valid grid that ignores the givens
    swapped = solution[1] + solution[0] + solution[2:]
    completions = [
        right,
        right + "<|eos|><|eos|>",
        f"  {right}\n",
        right.replace(" ", "\n"),
        format_grid(other_valid),
        format_grid(swapped),
        right + " 1234",  # a fifth row
        right[:-1],  # a short row
        right.replace(" ", ""),  # no row breaks
        right[:5] + "0" + right[6:],  # a blank left in
        right + "x",
        "",
        "<|eos|>" + right,
    ]
    expected = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert sudoku_reward(completions, [puzzle] * len(completions)) == expected
    assert sudoku_reward([[{"role": "assistant", "content": right}]], [puzzle]) == [1.0]
    with pytest.raises(ValueError):
        sudoku_reward([right], [puzzle, puzzle])


def test_reward_accepts_any_valid_solution_of_a_puzzle_with_several(grids):
    puzzle = "0" * 16
    assert sudoku_reward([format_grid(g) for g in sorted(grids)[:5]], [puzzle] * 5) == [1.0] * 5


def test_cell_reward_gives_partial_credit_only_to_well_formed_grids_that_keep_the_givens():
    puzzle, solution = sudoku_puzzles("test")[0]
    blanks = [i for i, c in enumerate(puzzle) if c == "0"]
    one_wrong = list(solution)
    one_wrong[blanks[0]] = "1234".replace(solution[blanks[0]], "")[0]
    given = next(i for i, c in enumerate(puzzle) if c != "0")
    given_changed = list(solution)
    given_changed[given] = "1234".replace(solution[given], "")[0]
    completions = [
        format_grid(solution),
        format_grid("".join(one_wrong)),
        format_grid("".join(given_changed)),  # a wrong given: no credit at all
        format_grid(solution) + " 1234",
        format_grid(solution[:15] + "5"),
        "",
    ]
    scores = sudoku_cell_reward(completions, [puzzle] * len(completions))
    assert scores == [1.0, pytest.approx(1 - 1 / len(blanks)), 0.0, 0.0, 0.0, 0.0]
    for p, s in sudoku_puzzles("validation")[:50]:  # 1.0 exactly when the binary reward is 1
        wrong = format_grid(s[::-1])
        assert sudoku_cell_reward([format_grid(s), wrong], [p, p])[0] == 1.0
        assert (sudoku_cell_reward([wrong], [p])[0] == 1.0) == bool(sudoku_reward([wrong], [p])[0])


def test_solve_finds_the_unique_solution(grids):
    for puzzle, solution in sudoku_puzzles("train")[:200]:
        assert solve(puzzle) == solution
    with pytest.raises(ValueError, match="solutions"):
        solve("0" * 16)


def test_parse_grid():
    assert parse_grid("1234 3412 2143 4321") == "1234341221434321"
    assert parse_grid("1234 3412 2143") is None and parse_grid("12345 3412 2143 4321") is None


# ----------------------------------------------------------------------------------------- shipped checkpoints
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["sudoku", "sudoku_noisy_teacher", "sudoku_causal", "sudoku_diffusion_gemma",
                                  "sudoku_diffusion_gemma_noisy_teacher"])
def test_shipped_checkpoint_files_are_small(name):
    folder = toy_assets_dir(name)
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 10 * 2**20
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json", "pretrain_summary.json"):
        assert (folder / file).is_file(), file


@pytest.fixture(scope="module")
def noisy_teacher_greedy():
    """The noisy-teacher toy's greedy decoding of the test split, scored by the binary reward (decoded once)."""
    model, tokenizer = load_sudoku_noisy_teacher()
    return evaluate_accuracy(model, tokenizer, sudoku_dataset("test"), sudoku_generation_config(), 100, sudoku_reward)


def test_shipped_toys_are_partly_competent_on_held_out_puzzles(noisy_teacher_greedy):
    test = sudoku_dataset("test")
    model, tokenizer = load_sudoku()
    diffusion = evaluate_accuracy(model, tokenizer, test, sudoku_generation_config(), 100, sudoku_reward)
    causal_model, causal_tokenizer = load_sudoku_causal()
    causal = evaluate_causal_accuracy(causal_model, causal_tokenizer, test, SUDOKU_GEN_LENGTH, 100, sudoku_reward)
    noisy = noisy_teacher_greedy
    for result in (diffusion, causal, noisy):
        assert 0.15 <= result["accuracy"] <= 0.40, (diffusion["accuracy"], causal["accuracy"], noisy["accuracy"])
    for result in (diffusion, noisy):
        assert result["nfe"] == 2 * SUDOKU_GEN_LENGTH  # one cell per step: 20 decoding steps per batch
        assert all(MASK not in c for c in result["completions"])


def test_noisy_teacher_toy_writes_both_conventions_and_is_competent_up_to_relabelling(noisy_teacher_greedy):
    """What RL has to fix in the main job: a good share of greedy answers solve the puzzle with 1 and 2 exchanged."""
    plain = noisy_teacher_greedy
    either = sudoku_up_to_relabelling_reward(plain["completions"], list(sudoku_dataset("test")["puzzle"]))
    relabelled_share = sum(either) / len(either) - plain["accuracy"]
    assert relabelled_share >= 0.15 and sum(either) / len(either) >= 0.5, (plain["accuracy"], relabelled_share)


SHIPPED_PRETRAINING = {  # checkpoint -> the flags of scripts/pretrain_sudoku.py that produced it
    "sudoku": ["--model-kind", "diffusion"],
    "sudoku_causal": ["--model-kind", "causal"],
    "sudoku_noisy_teacher": ["--relabel-fraction", "0.5", "--target-accuracy", "0.6", "--threads", "1"],
    "sudoku_diffusion_gemma": ["--model-kind", "diffusion_gemma"],
    "sudoku_diffusion_gemma_noisy_teacher": ["--model-kind", "diffusion_gemma", "--relabel-fraction", "0.5",
                                             "--target-accuracy", "0.6", "--threads", "1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHIPPED_PRETRAINING))
def test_script_reproduces_the_shipped_checkpoints(tmp_path, name):
    """Bit-exact on the software stack and CPU that produced the shipped files (2 threads unless the flags say)."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_sudoku.py"), "--output-dir", str(tmp_path),
                    *SHIPPED_PRETRAINING[name]], check=True)
    shipped = toy_assets_dir(name)
    assert json.loads((tmp_path / "pretrain_summary.json").read_text()) == json.loads(
        (shipped / "pretrain_summary.json").read_text())
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(shipped / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
