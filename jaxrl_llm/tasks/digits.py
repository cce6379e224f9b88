"""The built-in task: answer ``"a+b="`` with the single digit ``(a + b) mod 10``.

Small enough to train a tiny language model from scratch on a CPU, with a reward that
is checked exactly: 1 for the right digit, plus 0.5 for stopping right after it.
Prompts and rewards live on the host; the task owns its character tokenizer. It is a
:class:`jaxrl_llm.tasks.Task`: an unbounded train split (example ``i`` drawn from
``(seed, i)``) and a test split of all 100 sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import transformers

from jaxrl_llm.tasks.base import PromptBatch, RewardFn, check_split, encode_prompts
from jaxrl_llm.tasks.char_tokenizer import DIGITS_AND_OPERATORS, build_char_tokenizer


@dataclasses.dataclass(frozen=True)
class DigitSumTask:
    """Prompts ``"a+b="`` for digits ``a, b``; the answer is ``str((a + b) % 10)``."""

    tokenizer: transformers.PreTrainedTokenizerBase = dataclasses.field(
        default_factory=lambda: build_char_tokenizer(DIGITS_AND_OPERATORS)
    )

    stop_strings: tuple[str, ...] = ()

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def reward_fns(self) -> tuple[RewardFn, ...]:
        return (self.correct, self.stops)

    @property
    def reward_weights(self) -> tuple[float, ...]:
        return (1.0, 1.0)

    def split_size(self, split: str) -> int | None:
        """Train: unbounded; test: the 100 sums ``a+b`` in order (``index = 10 a + b``)."""
        check_split(split)
        return None if split == "train" else 100

    def examples(self, split: str, indices: np.ndarray, *, seed: int) -> PromptBatch:
        """Train example ``i``: two digits drawn from ``(seed, i)``; test example ``i``: ``i // 10 + i % 10``."""
        indices = np.asarray(indices, np.int64)
        if self.split_size(split) is None:
            digits = np.array([np.random.default_rng((seed, int(i))).integers(0, 10, size=2) for i in indices])
        else:
            digits = np.stack([indices // 10, indices % 10], axis=1)
        digits = digits.reshape(len(indices), 2)
        return self._batch(digits, indices)

    def prompts(self, rng: np.random.Generator, count: int) -> PromptBatch:
        """``count`` prompts of random digits drawn from ``rng``, outside the splits (their
        ``indices`` are -1): for warm starts and tests that bring their own generator."""
        return self._batch(rng.integers(0, 10, size=(count, 2)), np.full(count, -1))

    def _batch(self, digits: np.ndarray, indices: np.ndarray) -> PromptBatch:
        texts = [f"{a}+{b}=" for a, b in digits]
        tokens, mask = encode_prompts(self.tokenizer, texts, pad_id=self.pad_id)  # [P, 4]
        return PromptBatch(
            tokens=tokens,
            mask=mask,
            prompts=texts,
            columns={"answer": [int(a) for a in digits.sum(1) % 10]},
            indices=indices,
        )

    def correct(self, *, completion_ids: Sequence[Sequence[int]], answer: Sequence[int], **kwargs) -> list[float]:
        """1 where the completion's first token is the answer digit (a reward function)."""
        return self._component("correct", completion_ids, answer)

    def stops(self, *, completion_ids: Sequence[Sequence[int]], answer: Sequence[int], **kwargs) -> list[float]:
        """0.5 where EOS follows a correct digit (a reward function)."""
        return self._component("stops", completion_ids, answer)

    def _component(self, name: str, completion_ids: Sequence[Sequence[int]], answer: Sequence[int]) -> list[float]:
        width = max([1, *(len(ids) for ids in completion_ids)])
        tokens = np.full((len(completion_ids), width), self.pad_id, np.int32)
        for row, ids in enumerate(completion_ids):
            tokens[row, : len(ids)] = ids
        lengths = np.array([len(ids) for ids in completion_ids])
        return self.reward_components(tokens, lengths, np.asarray(answer))[name].tolist()

    def reward_components(
        self, completion_tokens: np.ndarray, lengths: np.ndarray, answers: np.ndarray
    ) -> dict[str, np.ndarray]:
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

    def demonstrations(
        self, rng: np.random.Generator, count: int, max_new_tokens: int, *, label_noise: float = 0.0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``count`` solved examples for a supervised warm start: ``tokens [count, S + N]``
        (prompt, answer digit, EOS, pad), ``attention_mask`` and ``completion_mask``
        ``[count, N]`` (the answer and EOS). With ``label_noise`` the answer is replaced by
        a uniformly random digit with that probability: a model fitted to it knows the
        answers but is unsure of them, the state RL then sharpens."""
        if max_new_tokens < 2:
            raise ValueError(f"demonstrations: `max_new_tokens` must be >= 2 (answer and EOS); got {max_new_tokens}.")
        prompts = self.prompts(rng, count)
        prompt_ids, prompt_mask, answers = prompts.tokens, prompts.mask, np.asarray(prompts.columns["answer"])
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
