"""A few problems in each raw column layout, written for this package (not taken from the benchmarks).

They make the example scripts, the evaluation CLI and the tests run offline: ``sample_dataset("mbpp")`` is a
tiny MBPP-shaped set, ``sample_dataset("gsm8k")`` a GSM8K-shaped one, and so on.
"""

from __future__ import annotations

from datasets import Dataset

SAMPLE_ROWS: dict[str, list[dict]] = {
    "gsm8k": [
        {
            "question": "A baker fills 6 trays with 12 rolls each and sells 50 rolls. How many rolls are left?",
            "answer": "The trays hold 6 * 12 = <<6*12=72>>72 rolls.\n"
            "After selling, 72 - 50 = <<72-50=22>>22 remain.\n#### 22",
        },
        {
            "question": "Mia reads 15 pages a day for 4 days and then 20 pages on the fifth day. "
            "How many pages did she read?",
            "answer": "Four days give 15 * 4 = <<15*4=60>>60 pages.\n"
            "With the fifth day, 60 + 20 = <<60+20=80>>80.\n#### 80",
        },
        {
            "question": "A ticket costs $7. How much do 3 adults and 2 children pay if children pay half price?",
            "answer": "Adults pay 3 * 7 = <<3*7=21>>21.\nA child pays 7 / 2 = <<7/2=3.5>>3.5, so 2 * 3.5 = 7.\n"
            "Together 21 + 7 = <<21+7=28>>28.\n#### 28",
        },
        {
            "question": "A tank holds 1,200 liters and leaks 25 liters an hour. How many liters remain after 8 hours?",
            "answer": "It loses 25 * 8 = <<25*8=200>>200 liters.\n1200 - 200 = <<1200-200=1000>>1000.\n#### 1000",
        },
    ],
    "math": [
        {
            "problem": "What is the value of $\\frac{3}{4} + \\frac{1}{6}$?",
            "solution": "With denominator 12: $\\frac{9}{12} + \\frac{2}{12} = \\boxed{\\frac{11}{12}}$.",
            "level": "Level 1",
            "type": "Prealgebra",
        },
        {
            "problem": "Solve for $x$: $5x - 7 = 2x + 8$.",
            "solution": "Subtract $2x$ and add 7: $3x = 15$, so $x = \\boxed{5}$.",
            "level": "Level 1",
            "type": "Algebra",
        },
        {
            "problem": "How many positive divisors does $36$ have?",
            "solution": "$36 = 2^2 3^2$ has $(2+1)(2+1) = \\boxed{9}$ divisors.",
            "level": "Level 2",
            "type": "Number Theory",
        },
    ],
    "math500": [
        {
            "problem": "Compute $\\sqrt{49} + 2^3$.",
            "solution": "$\\sqrt{49} = 7$ and $2^3 = 8$, so the sum is $\\boxed{15}$.",
            "answer": "15",
            "subject": "Prealgebra",
            "level": 1,
            "unique_id": "sample/prealgebra/1.json",
        },
        {
            "problem": "What is the slope of the line through $(1, 2)$ and $(3, 8)$?",
            "solution": "The slope is $\\frac{8-2}{3-1} = \\boxed{3}$.",
            "answer": "3",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "sample/algebra/2.json",
        },
    ],
    "mbpp": [
        {
            "task_id": 1,
            "text": "Write a function to return the sum of the squares of a list of integers.",
            "code": "def sum_of_squares(values):\n    return sum(v * v for v in values)",
            "test_list": [
                "assert sum_of_squares([1, 2, 3]) == 14",
                "assert sum_of_squares([]) == 0",
                "assert sum_of_squares([-4]) == 16",
            ],
            "test_setup_code": "",
            "challenge_test_list": [],
        },
        {
            "task_id": 2,
            "text": "Write a function to check whether a string reads the same forwards and backwards.",
            "code": "def is_mirror(text):\n    return text == text[::-1]",
            "test_list": ["assert is_mirror('level')", "assert not is_mirror('levels')", "assert is_mirror('')"],
            "test_setup_code": "",
            "challenge_test_list": [],
        },
        {
            "task_id": 3,
            "text": "Write a function to count the vowels in a string.",
            "code": "def count_vowels(text):\n    return sum(ch in 'aeiouAEIOU' for ch in text)",
            "test_list": [
                "assert count_vowels('banana') == 3",
                "assert count_vowels('rhythm') == 0",
                "assert count_vowels('AEIOU') == 5",
            ],
            "test_setup_code": "",
            "challenge_test_list": [],
        },
        {
            "task_id": 4,
            "text": "Write a function to return the largest gap between neighbouring numbers of a list once sorted.",
            "code": "def widest_gap(values):\n    s = sorted(values)\n    return max(b - a for a, b in zip(s, s[1:]))",
            "test_list": [
                "assert widest_gap([1, 9, 4]) == 5",
                "assert widest_gap([3, 3]) == 0",
                "assert widest_gap([10, 0, 5, 6]) == 5",
            ],
            "test_setup_code": "",
            "challenge_test_list": [],
        },
    ],
    "humaneval": [
        {
            "task_id": "Sample/0",
            "prompt": "def running_max(numbers: list) -> list:\n"
            '    """Return the list of maxima of every prefix of numbers.\n'
            "    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n"
            '    """\n',
            "canonical_solution": "    out, best = [], None\n    for n in numbers:\n"
            "        best = n if best is None else max(best, n)\n        out.append(best)\n    return out\n",
            "test": "def check(candidate):\n    assert candidate([1, 3, 2, 5]) == [1, 3, 3, 5]\n"
            "    assert candidate([]) == []\n    assert candidate([4, 1]) == [4, 4]\n",
            "entry_point": "running_max",
        },
        {
            "task_id": "Sample/1",
            "prompt": "def shout(word: str) -> str:\n"
            '    """Return word in upper case followed by an exclamation mark.\n'
            "    >>> shout('hi')\n    'HI!'\n"
            '    """\n',
            "canonical_solution": "    return word.upper() + '!'\n",
            "test": "def check(candidate):\n    assert candidate('hi') == 'HI!'\n    assert candidate('') == '!'\n",
            "entry_point": "shout",
        },
    ],
}
"""Raw rows per layout, with the columns (and column types) of the public datasets."""


def sample_dataset(layout: str) -> Dataset:
    """The sample rows of ``layout`` (``gsm8k``, ``math``, ``math500``, ``mbpp``, ``humaneval``) as a raw dataset."""
    if layout not in SAMPLE_ROWS:
        raise ValueError(f"No sample rows for {layout!r}; expected one of {sorted(SAMPLE_ROWS)}.")
    return Dataset.from_list(SAMPLE_ROWS[layout])
