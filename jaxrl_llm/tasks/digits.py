"""The built-in task: answer ``"a+b="`` with the single digit ``(a + b) mod 10``.

Small enough to train a tiny language model from scratch on a CPU, with a reward that
is checked exactly: 1 for the right digit, plus 0.5 for stopping right after it.
Prompts and rewards live on the host; the task owns its character tokenizer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import transformers

from jaxrl_llm.models.tokenizer import DIGITS_AND_OPERATORS, build_char_tokenizer


@dataclasses.dataclass(frozen=True)
class DigitSumTask:
    """Prompts ``"a+b="`` for digits ``a, b``; the answer is ``str((a + b) % 10)``."""

    tokenizer: transformers.PreTrainedTokenizerBase = dataclasses.field(
        default_factory=lambda: build_char_tokenizer(DIGITS_AND_OPERATORS)
    )

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def prompts(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``count`` random prompts: token ids ``[P, 4]``, mask ``[P, 4]`` and answers ``[P]``."""
        digits = rng.integers(0, 10, size=(count, 2))
        texts = [f"{a}+{b}=" for a, b in digits]
        encoded = self.tokenizer(texts, padding=True, return_tensors="np")
        return encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(bool), digits.sum(1) % 10

    def rewards(self, completion_tokens: np.ndarray, lengths: np.ndarray, answers: np.ndarray) -> np.ndarray:
        """``[B]`` float32: 1 if the first token is the answer digit, +0.5 if EOS follows it.

        Args:
          completion_tokens: ``[B, N]`` sampled ids.
          lengths: ``[B]`` valid completion tokens (EOS included).
          answers: ``[B]`` the answer digit of each row's prompt.
        """
        answer_ids = np.asarray(self.tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))[answers]
        correct = completion_tokens[:, 0] == answer_ids
        stops = (lengths == 2) & (completion_tokens[:, min(1, completion_tokens.shape[1] - 1)] == self.eos_id)
        return (correct.astype(np.float32) + 0.5 * (correct & stops)).astype(np.float32)
