"""Prompt sources with rewards: the :class:`Task` protocol and the built-in tasks.

The package exports what a user calls or implements; the library's own helpers stay in
their modules (``tasks.base.draw``, the trainer's prompt stream; ``tasks.base.encode_prompts``,
``tasks.base.SPLITS``, ...).
"""

from jaxrl_llm.tasks.base import PromptBatch, RewardFn, Task, check_task
from jaxrl_llm.tasks.calculator import CalculatorTask
from jaxrl_llm.tasks.char_tokenizer import DIGITS_AND_OPERATORS, build_char_tokenizer, build_chat_tokenizer
from jaxrl_llm.tasks.digits import DigitSumTask
from jaxrl_llm.tasks.expressions import arithmetic
from jaxrl_llm.tasks.reasoning_gym_tasks import reasoning_gym
from jaxrl_llm.tasks.text import TextTask, environment_task, from_dataset, from_jsonl, from_records

__all__ = [
    "DIGITS_AND_OPERATORS",
    "CalculatorTask",
    "DigitSumTask",
    "PromptBatch",
    "RewardFn",
    "Task",
    "TextTask",
    "arithmetic",
    "build_char_tokenizer",
    "build_chat_tokenizer",
    "check_task",
    "environment_task",
    "from_dataset",
    "from_jsonl",
    "from_records",
    "reasoning_gym",
]
