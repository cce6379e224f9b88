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

    def reward_components(self, completion_tokens: np.ndarray, lengths: np.ndarray,
                          answers: np.ndarray) -> dict[str, np.ndarray]:
        """The reward functions, each ``[B]`` float32: ``correct`` (1 if the first token is
        the answer digit) and ``stops`` (0.5 if EOS follows a correct digit).

        Args:
          completion_tokens: ``[B, N]`` sampled ids.
          lengths: ``[B]`` valid completion tokens (EOS included).
          answers: ``[B]`` the answer digit of each row's prompt.
        """
        correct = completion_tokens[:, 0] == self.answer_ids(answers)
        stops = (lengths == 2) & (completion_tokens[:, min(1, completion_tokens.shape[1] - 1)] == self.eos_id)
        return {"correct": correct.astype(np.float32), "stops": (0.5 * (correct & stops)).astype(np.float32)}

    def rewards(self, completion_tokens: np.ndarray, lengths: np.ndarray, answers: np.ndarray) -> np.ndarray:
        """``[B]`` float32: the sum of :meth:`reward_components` (1 for the right digit,
        +0.5 if EOS follows it)."""
        return sum(self.reward_components(completion_tokens, lengths, answers).values())

    def answer_ids(self, answers: np.ndarray) -> np.ndarray:
        """``[B]`` token ids of the answer digits."""
        return np.asarray(self.tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))[answers]

    def demonstrations(self, rng: np.random.Generator, count: int, max_new_tokens: int, *,
                       label_noise: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``count`` solved examples for a supervised warm start: ``tokens [count, S + N]``
        (prompt, answer digit, EOS, pad), ``attention_mask`` and ``completion_mask``
        ``[count, N]`` (the answer and EOS). With ``label_noise`` the answer is replaced by
        a uniformly random digit with that probability: a model fitted to it knows the
        answers but is unsure of them, the state RL then sharpens."""
        if max_new_tokens < 2:
            raise ValueError(f"demonstrations: `max_new_tokens` must be >= 2 (answer and EOS); got {max_new_tokens}.")
        prompt_ids, prompt_mask, answers = self.prompts(rng, count)
        completion = np.full((count, max_new_tokens), self.pad_id, np.int32)
        noisy = rng.random(count) < label_noise
        answers = np.where(noisy, rng.integers(0, 10, size=count), answers)
        completion[:, 0] = self.answer_ids(answers)
        completion[:, 1] = self.eos_id
        completion_mask = np.arange(max_new_tokens)[None, :] < 2
        completion_mask = np.broadcast_to(completion_mask, (count, max_new_tokens))
        tokens = np.concatenate([prompt_ids, completion], axis=1)
        attention_mask = np.concatenate([prompt_mask, completion_mask], axis=1)
        return tokens, attention_mask, completion_mask.copy()
