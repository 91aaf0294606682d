"""The python blocks of docs/rewards.md run as written."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "rewards.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", BLOCKS)
def test_doc_block_runs(code):
    exec(compile(code, str(DOC), "exec"), {})


def test_doc_has_examples():
    assert BLOCKS
