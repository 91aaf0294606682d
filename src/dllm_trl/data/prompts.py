r"""Paper 1's prompts (App. D): math asks for step-by-step reasoning and a final ``\boxed{}`` answer, code asks
for the solution in one ```` ```python ```` block. They become the user turn of a one-turn chat, which the
tokenizer's chat template renders (TRL does this itself for conversational ``prompt`` columns).

The paper's exact wording was lost with its appendix; the texts below are ours and carry the two
instructions the rewards depend on (:func:`~dllm_trl.rewards.math_reward` reads the last ``\boxed{}``,
:func:`~dllm_trl.rewards.code_reward` the last ```` ```python ```` block).
"""

from __future__ import annotations

from collections.abc import Sequence

MATH_INSTRUCTION = (
    "Think through the problem step by step and show your reasoning. "
    "End your response with the final answer written inside \\boxed{}."
)
"""Appended to every math problem."""

CODE_INSTRUCTION = (
    "Write a correct, self-contained Python solution. Reason about it briefly, then give the complete code "
    "(with any imports it needs) in a single ```python code block."
)
"""Appended to every programming task."""


def math_prompt(problem: str) -> str:
    """The user turn for a math problem."""
    return f"{problem.strip()}\n\n{MATH_INSTRUCTION}"


def code_prompt(task: str | None = None, tests: Sequence[str] | None = None, starter_code: str | None = None) -> str:
    """The user turn for a programming task.

    ``task``: the description (MBPP). ``tests``: assert statements shown to the model so it knows the expected
    function name and signature (MBPP convention). ``starter_code``: a signature with its docstring that the
    solution must complete (HumanEval).
    """
    parts = []
    if task:
        parts.append(task.strip())
    if starter_code:
        parts.append(f"Complete this Python function:\n```python\n{starter_code.rstrip()}\n```")
    if tests:
        parts.append("Your code should pass these tests:\n" + "\n".join(t.strip() for t in tests))
    if not parts:
        raise ValueError("code_prompt needs a task description or starter code.")
    instruction = CODE_INSTRUCTION
    if starter_code:
        instruction += " Include the whole function, signature included."
    parts.append(instruction)
    return "\n\n".join(parts)


def as_conversation(text: str, system_prompt: str | None = None) -> list[dict]:
    """A one-turn chat (TRL's conversational ``prompt`` format), optionally after a system message."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": text}]


def render_prompt(tokenizer, prompt: str | list[dict]) -> str:
    """The text the model sees: a conversation through the tokenizer's chat template with the assistant turn
    opened; a plain string as is."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "The tokenizer has no chat template, so conversational prompts cannot be rendered; load the "
            "dataset with conversational=False or set tokenizer.chat_template."
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
