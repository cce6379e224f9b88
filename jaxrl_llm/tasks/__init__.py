"""Prompt sources with rewards: the :class:`Task` protocol and the built-in tasks."""

from jaxrl_llm.tasks.base import (
    SPLITS,
    PromptBatch,
    RewardFn,
    Task,
    check_split,
    check_task,
    draw,
    encode_prompts,
    special_ids,
    stream_indices,
)
from jaxrl_llm.tasks.char_tokenizer import DIGITS_AND_OPERATORS, build_char_tokenizer
from jaxrl_llm.tasks.digits import DigitSumTask
from jaxrl_llm.tasks.text import TextTask, from_dataset, from_jsonl, from_records
from jaxrl_llm.tasks.expressions import arithmetic
from jaxrl_llm.tasks.reasoning_gym_tasks import reasoning_gym

__all__ = [
    "DIGITS_AND_OPERATORS", "DigitSumTask", "PromptBatch", "RewardFn", "SPLITS", "Task", "TextTask", "arithmetic",
    "build_char_tokenizer", "check_split", "check_task", "draw", "encode_prompts", "from_dataset", "from_jsonl",
    "from_records", "reasoning_gym", "special_ids", "stream_indices",
]
