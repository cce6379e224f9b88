"""Prompt sources with verifiable rewards."""

from jaxrl_llm.tasks.digits import DigitSumTask

__all__ = ["DigitSumTask"]
