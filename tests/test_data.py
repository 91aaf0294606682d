"""dllm_trl.data: paper 1's prompts, the GSM8K / MATH / MBPP / HumanEval adapters, loading, length filter."""

from __future__ import annotations

import pytest
from datasets import Dataset

from dllm_trl.data import (
    CODE_INSTRUCTION,
    DATASET_FORMATS,
    MATH_INSTRUCTION,
    PRESETS,
    DatasetArguments,
    MissingColumnError,
    code_prompt,
    detect_format,
    filter_by_length,
    load_raw_dataset,
    load_task_dataset,
    math_prompt,
    prepare_dataset,
    render_prompt,
    sample_dataset,
    task_reward,
)
from dllm_trl.rewards import code_reward, math_reward
from dllm_trl.toy import build_toy_tokenizer

from .conftest import make_char_tokenizer

EXPECTED = {
    "gsm8k": ("gsm8k", "math", {"prompt", "answer", "solution"}),
    "math": ("math", "math", {"prompt", "answer", "solution", "level", "type"}),
    "math500": ("math", "math", {"prompt", "answer", "solution", "level", "subject", "unique_id"}),
    "mbpp": ("mbpp", "code", {"prompt", "tests", "test_setup_code", "test_imports", "solution", "task_id"}),
    "humaneval": ("humaneval", "code", {"prompt", "test", "entry_point", "code_prefix", "solution", "task_id"}),
}


def test_prompts_carry_the_instructions_the_rewards_depend_on():
    math = math_prompt("  What is 2+3?  ")
    assert math.startswith("What is 2+3?") and math.endswith(MATH_INSTRUCTION) and "\\boxed{}" in math
    code = code_prompt("Write a function add.", tests=["assert add(1, 2) == 3"])
    assert "```python" in code and "assert add(1, 2) == 3" in code and CODE_INSTRUCTION in code
    starter = code_prompt(starter_code="def f(x):\n    '''Double x.'''\n")
    assert "```python\ndef f(x):" in starter and "signature included" in starter
    with pytest.raises(ValueError):
        code_prompt()


def test_render_prompt_applies_the_chat_template():
    tokenizer = build_toy_tokenizer()
    text = render_prompt(tokenizer, [{"role": "user", "content": "1+2="}])
    assert text == "<|bos|><|user|>1+2=<|assistant|>"
    assert render_prompt(tokenizer, "1+2=") == "1+2="
    with pytest.raises(ValueError, match="chat template"):
        render_prompt(make_char_tokenizer(), [{"role": "user", "content": "1+2="}])


@pytest.mark.parametrize("layout", sorted(EXPECTED))
def test_each_layout_is_detected_and_mapped(layout):
    raw = sample_dataset(layout)
    name, task, columns = EXPECTED[layout]
    fmt = detect_format(raw.column_names)
    assert (fmt.name, fmt.task) == (name, task)
    prepared = prepare_dataset(raw)
    assert set(prepared.column_names) == columns and len(prepared) == len(raw)
    messages = prepared[0]["prompt"]
    assert [m["role"] for m in messages] == ["user"]
    instruction = MATH_INSTRUCTION if task == "math" else CODE_INSTRUCTION
    assert instruction in messages[0]["content"]
    # Already prepared data passes through unchanged, so preparing twice is harmless.
    assert detect_format(prepared.column_names).name.startswith("prepared_")
    assert prepare_dataset(prepared) is prepared


@pytest.mark.parametrize("layout", ["gsm8k", "math", "math500"])
def test_math_answers_and_reference_solutions_score_one(layout):
    prepared = prepare_dataset(sample_dataset(layout))
    answers = prepared["answer"]
    assert all(a and "####" not in a and "boxed" not in a for a in answers)
    completions = [f"So the result is \\boxed{{{a}}}." for a in answers]
    assert math_reward(completions, answer=answers) == [1.0] * len(answers)
    assert math_reward(["\\boxed{-1}"] * len(answers), answer=answers) == [0.0] * len(answers)


def test_gsm8k_answer_is_the_number_after_the_marks():
    prepared = prepare_dataset(sample_dataset("gsm8k"))
    assert list(prepared["answer"]) == ["22", "80", "28", "1000"]
    assert prepared[0]["solution"].endswith("#### 22")


@pytest.mark.parametrize("layout", ["mbpp", "humaneval"])
def test_code_reference_solutions_pass_their_tests(layout):
    prepared = prepare_dataset(sample_dataset(layout)).select([0])
    columns = {c: list(prepared[c]) for c in prepared.column_names if c != "prompt"}
    good = [f"Here it is:\n```python\n{prepared[0]['solution']}\n```"]
    assert code_reward(good, **columns) == [1.0]
    assert code_reward(["no code block here"], **columns) == [0.0]


def test_mbpp_sanitized_layout_reads_the_description_from_prompt():
    raw = Dataset.from_list([
        {"prompt": "Write a function to triple a number.", "code": "def triple(x):\n    return 3 * x",
         "test_list": ["assert triple(2) == 6"], "test_imports": ["import math"], "task_id": 7, "source_file": "x"}
    ])
    prepared = prepare_dataset(raw)
    assert prepared[0]["prompt"][0]["content"].startswith("Write a function to triple a number.")
    assert prepared[0]["tests"] == ["assert triple(2) == 6"] and prepared[0]["test_imports"] == ["import math"]
    assert "source_file" not in prepared.column_names


def test_plain_text_prompts_and_system_prompt():
    raw = sample_dataset("gsm8k")
    plain = prepare_dataset(raw, conversational=False)
    assert isinstance(plain[0]["prompt"], str) and plain[0]["prompt"] == math_prompt(raw[0]["question"])
    chat = prepare_dataset(raw, system_prompt="You are a careful solver.")
    assert [m["role"] for m in chat[0]["prompt"]] == ["system", "user"]


def test_missing_column_error_names_the_column():
    renamed = sample_dataset("gsm8k").rename_column("question", "query")
    with pytest.raises(MissingColumnError, match="'question'") as error:
        prepare_dataset(renamed, layout="gsm8k")
    assert error.value.column == "question" and "query" in str(error.value)
    assert isinstance(error.value, ValueError)
    # Auto-detection reports the closest layout's missing column.
    with pytest.raises(MissingColumnError, match="'question'"):
        prepare_dataset(renamed)
    with pytest.raises(MissingColumnError, match="'test_list'"):
        prepare_dataset(sample_dataset("mbpp").remove_columns("test_list"), layout="mbpp")
    with pytest.raises(MissingColumnError, match=r"'text' \(or 'prompt'\)"):
        prepare_dataset(sample_dataset("mbpp").remove_columns("text"), layout="mbpp")
    with pytest.raises(ValueError, match="Unknown dataset layout"):
        prepare_dataset(renamed, layout="gsm9k")
    assert set(DATASET_FORMATS) >= {"gsm8k", "math", "mbpp", "humaneval"}


@pytest.mark.parametrize("extension", ["json", "jsonl", "parquet"])
def test_local_files_load_and_map(tmp_path, extension):
    path = tmp_path / f"problems.{extension}"
    raw = sample_dataset("mbpp")
    (raw.to_parquet if extension == "parquet" else raw.to_json)(str(path))
    assert len(load_raw_dataset(str(path))) == len(raw)
    prepared = load_task_dataset(str(path), size=2)
    assert len(prepared) == 2 and "tests" in prepared.column_names
    assert load_task_dataset(str(path), layout="mbpp", conversational=False)[0]["prompt"].startswith("Write")


def test_bad_local_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_raw_dataset(str(tmp_path / "missing.jsonl"))
    text = tmp_path / "problems.txt"
    text.write_text("1+1=2\n")
    with pytest.raises(ValueError, match="expected a"):
        load_raw_dataset(str(text))


def test_presets_and_hub_names_go_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return sample_dataset("gsm8k")

    monkeypatch.setattr("dllm_trl.data.loading.load_dataset", fake_load_dataset)
    prepared = load_task_dataset("gsm8k", split="test", size=3)
    assert calls[-1] == ("openai/gsm8k", "main", "test") and len(prepared) == 3
    load_raw_dataset("someone/my-math", split="train", config="v2")
    assert calls[-1] == ("someone/my-math", "v2", "train")
    assert {"gsm8k", "math", "math500", "mbpp", "humaneval"} <= set(PRESETS)


def test_filter_by_length_counts_prompt_and_solution():
    tokenizer = build_toy_tokenizer()
    prepared = prepare_dataset(sample_dataset("gsm8k"))
    lengths = [
        len(tokenizer(render_prompt(tokenizer, row["prompt"]) + row["solution"], add_special_tokens=False)["input_ids"])
        for row in prepared
    ]
    cut = sorted(lengths)[1]
    kept = filter_by_length(prepared, tokenizer, cut)
    assert len(kept) == sum(n <= cut for n in lengths) == 2


def test_dataset_arguments_load(tmp_path):
    path = tmp_path / "train.jsonl"
    sample_dataset("gsm8k").to_json(str(path))
    tokenizer = build_toy_tokenizer()
    assert len(DatasetArguments(dataset_name=str(path), train_size=3).load("math")) == 3
    assert len(DatasetArguments(dataset_name=str(path), max_sequence_length=10_000).load("math", tokenizer)) == 4
    with pytest.raises(ValueError, match="no training problems of at most 5 tokens"):
        DatasetArguments(dataset_name=str(path), max_sequence_length=5).load("math", tokenizer)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        DatasetArguments(dataset_name=str(path), max_sequence_length=5).load("math")


def test_task_reward():
    assert task_reward("math") is math_reward and task_reward("code") is code_reward
    with pytest.raises(ValueError):
        task_reward("poetry")


def test_math_row_without_any_answer_is_an_error():
    raw = Dataset.from_list([{"problem": "What is 1+1?", "solution": "It is two."}])
    with pytest.raises(ValueError, match="without an answer"):
        prepare_dataset(raw)


def test_an_undetectable_layout_lists_the_layouts_and_the_flag(tmp_path):
    """A q/a file matches no layout: the error says so, lists what each layout needs and names --dataset_layout,
    instead of claiming it is one layout that lacks a column."""
    path = tmp_path / "qa.jsonl"
    path.write_text('{"q": "1+1", "a": "2"}\n')
    with pytest.raises(MissingColumnError) as error:
        load_task_dataset(str(path))
    message = str(error.value)
    assert "No dataset layout matches the columns ['q', 'a']" in message and "--dataset_layout" in message
    assert "gsm8k: question + answer" in message and "mbpp: text/prompt + test_list" in message
    assert "The mbpp layout needs" not in message
