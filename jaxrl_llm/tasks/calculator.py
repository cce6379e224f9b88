r"""A multi-turn task with a tool: add two numbers, calling a calculator when the sum is too hard.

Each prompt is one user message, ``"a+b"``: an *easy* sum of two digits (``"3+4"``), which a
tiny model learns to answer directly, or a *hard* one of two 3-4 digit numbers (``"4821+937"``),
which it cannot add reliably (a left-to-right writer must know every carry before the first
digit) but can pass to the tool :func:`add`. An episode, in the chat template of
:func:`~jaxrl_llm.tasks.char_tokenizer.build_chat_tokenizer`:

.. code-block:: text

    <|tools|>add(a,b)<eos><|user|>4821+937<eos><|assistant|>
    <tool_call>{"name":"add","arguments":{"a":4821,"b":937}}</tool_call><eos>
    <|tool|>5758<eos><|assistant|>5758<eos>

(one line: 64 tokens, 60 to 68 for hard sums; an easy episode is 18 or 19). Rewards, in
TRL's convention, read the episode's messages (``completions``: the assistant messages, with
their ``tool_calls``, and the ``tool`` messages between them):

* :meth:`CalculatorTask.correct`: 1 when the last assistant message makes no call and its content
  is the sum's digits, else 0;
* :meth:`CalculatorTask.calls`: minus the number of tool results in the episode, weighted by
  ``call_cost``.

**Why the calls cost.** The tool is never wrong, so with correctness alone calling it is optimal
on *every* sum: a policy that always calls scores the same as one that calls only when it must,
and RL has no signal for *when* to call. A cost :math:`c` per call prices the choice: calling
earns :math:`1 - c`, answering directly earns the model's own accuracy :math:`p` on that sum, so
the best policy calls exactly when :math:`p < 1 - c`: on hard sums (:math:`p \approx 0`) and not
on easy ones (:math:`p \approx 1`). With the default :math:`c = 0.1` a call still beats any
answer the model gets right less than 90% of the time, and each repeated call in an episode pays
again. Group-normalised advantages (GRPO, RLOO) turn even this small gap into a full-size signal
once a group holds both behaviours.

The warm start: :meth:`CalculatorTask.demonstrations` gives solved conversations (easy sums
answered directly, hard ones through the tool) and :func:`sft_arrays` turns any conversations
into the arrays of :func:`jaxrl_llm.training.supervised_finetune`, learning the assistant's tokens
only:

.. code-block:: python

    task = CalculatorTask()
    tokens, attention_mask, completion_mask = sft_arrays(
        task.tokenizer, task.demonstrations(512, seed=0), tools=task.tools
    )
    params, losses = training.supervised_finetune(model, params, tokens, attention_mask, completion_mask, steps=200)
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import transformers

from jaxrl_llm.tasks.base import PromptBatch, RewardFn, check_split, left_pad, render_chat
from jaxrl_llm.tasks.char_tokenizer import build_chat_tokenizer

CALCULATOR_ALPHABET = "0123456789+abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ{}[]\":,_() '.-"
"""The characters of the calculator task: the sums, tool and argument names (letters and ``_``), the
JSON of tool calls (``{}[]":,``), the tool listing (``()``) and tool errors (space, ``'``, ``.``, ``-``)."""


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)):
        raise TypeError(f"add takes two integers; got {a!r} and {b!r}")
    return a + b


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorTask:
    """Sums ``"a+b"`` as conversations with the tool :func:`add`; the answer is ``a + b`` in digits.

    Attributes:
      tokenizer: a tokenizer with a chat template that renders tools and tool calls (default:
        :func:`~jaxrl_llm.tasks.char_tokenizer.build_chat_tokenizer` over :data:`CALCULATOR_ALPHABET`).
      hard_fraction: the probability that an example is hard, in ``[0, 1]``.
      hard_digits: ``(fewest, most)`` digits of a hard sum's operands, each operand's count drawn
        uniformly in that range (then the number uniformly among those with that many digits).
      call_cost: the weight of :meth:`calls` (the reward lost per tool call), in ``[0, 1)``.
      test_size: examples in the test split.
      stop_strings: texts that also end a turn.
    """

    tokenizer: transformers.PreTrainedTokenizerBase = dataclasses.field(
        default_factory=lambda: build_chat_tokenizer(CALCULATOR_ALPHABET)
    )
    hard_fraction: float = 0.5
    hard_digits: tuple[int, int] = (3, 4)
    call_cost: float = 0.1
    test_size: int = 200
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        fn = "CalculatorTask"
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"{fn}: the tokenizer has no chat template, and tools need one; use "
                f"jaxrl_llm.tasks.char_tokenizer.build_chat_tokenizer or a chat model's tokenizer."
            )
        if not (_real(self.hard_fraction) and 0.0 <= self.hard_fraction <= 1.0):
            raise ValueError(f"{fn}: `hard_fraction` must be a number in [0, 1]; got {self.hard_fraction!r}.")
        digits = self.hard_digits
        pair = isinstance(digits, tuple) and len(digits) == 2 and all(_integer(d) for d in digits)
        if not (pair and 1 <= digits[0] <= digits[1] <= 18):
            raise ValueError(
                f"{fn}: `hard_digits` must be a pair (fewest, most) of ints with 1 <= fewest <= most <= 18 (numbers "
                f"NumPy draws as int64); got {digits!r}."
            )
        if not (_real(self.call_cost) and 0.0 <= self.call_cost < 1.0):
            raise ValueError(
                f"{fn}: `call_cost` must be a number in [0, 1) (at 1 or more a call never pays); "
                f"got {self.call_cost!r}."
            )
        if not (_integer(self.test_size) and self.test_size >= 1):
            raise ValueError(f"{fn}: `test_size` must be a positive int; got {self.test_size!r}.")
        if isinstance(self.stop_strings, str):
            raise ValueError(f"{fn}: `stop_strings` must be a tuple of strings, not one string.")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The end-of-turn id: the tokenizer's EOS, which the template writes after every turn."""
        return (self.tokenizer.eos_token_id,)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def tools(self) -> tuple[Callable, ...]:
        """The tool functions the model may call (TRL's ``tools``): :func:`add`."""
        return (add,)

    @property
    def reward_fns(self) -> tuple[RewardFn, ...]:
        return (self.correct, self.calls)

    @property
    def reward_weights(self) -> tuple[float, ...]:
        return (1.0, float(self.call_cost))

    def split_size(self, split: str) -> int | None:
        """Train: unbounded; test: ``test_size`` examples."""
        check_split(split)
        return None if split == "train" else self.test_size

    def examples(self, split: str, indices: np.ndarray, *, seed: int) -> PromptBatch:
        """Train example ``i`` is drawn from ``(seed, i)``; test example ``i`` from ``i`` alone
        (``seed`` is ignored), on a stream no train seed reaches.

        ``prompts`` are conversations, ``[{"role": "user", "content": "a+b"}]``; ``tokens`` are
        each rendered with the tools' schemas and the generation prompt
        (:func:`jaxrl_llm.episodes.conversation.render_prompt`), left-padded. Columns:
        ``answer`` (``a + b``, int) and ``hard`` (bool).
        """
        size = self.split_size(split)
        indices = np.asarray(indices, np.int64).reshape(-1)
        if size is not None and len(indices) and (indices.min() < 0 or indices.max() >= size):
            raise IndexError(f"CalculatorTask.examples: indices must be in [0, {size}) for the test split.")
        streams = [(0, seed, int(i)) if size is None else (1, int(i)) for i in indices]
        sums = [self._draw(np.random.default_rng(stream)) for stream in streams]
        prompts = [[{"role": "user", "content": f"{a}+{b}"}] for a, b, _ in sums]
        tokens, mask = left_pad([self._render(p, generation=True) for p in prompts], pad_id=self.pad_id)
        return PromptBatch(
            tokens=tokens,
            mask=mask,
            prompts=prompts,
            columns={"answer": [a + b for a, b, _ in sums], "hard": [hard for _, _, hard in sums]},
            indices=indices,
        )

    def demonstrations(self, count: int, *, seed: int, tool_fraction: float | None = None) -> list[list[dict]]:
        """``count`` solved conversations for a supervised warm start, example ``i`` drawn from
        ``(seed, i)`` (a stream apart from the splits'): an easy sum answered directly,

        ``[user "3+4", assistant "7"]``,

        or a hard one through the tool,

        ``[user "4821+937", assistant (call add(a=4821, b=937)), tool "5758", assistant "5758"]``.

        With ``tool_fraction`` (in ``[0, 1]``) the choice ignores the difficulty: each sum goes
        through the tool with that probability, so a model fitted to them knows both forms but
        not when each pays, which RL then learns. :func:`sft_arrays` turns them into training
        arrays.
        """
        if not (_integer(count) and count >= 0):
            raise ValueError(f"CalculatorTask.demonstrations: `count` must be an int >= 0; got {count!r}.")
        if tool_fraction is not None and not (_real(tool_fraction) and 0 <= tool_fraction <= 1):
            raise ValueError(
                f"CalculatorTask.demonstrations: `tool_fraction` must be None or in [0, 1]; got {tool_fraction!r}."
            )
        conversations = []
        for i in range(count):
            rng = np.random.default_rng((2, seed, i))
            a, b, hard = self._draw(rng)
            user = {"role": "user", "content": f"{a}+{b}"}
            answer = {"role": "assistant", "content": str(a + b)}
            if hard if tool_fraction is None else rng.random() < tool_fraction:
                arguments = {"a": a, "b": b}
                call = {"type": "function", "function": {"name": add.__name__, "arguments": arguments}}
                conversations.append(
                    [
                        user,
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "name": add.__name__, "content": str(add(**arguments))},
                        answer,
                    ]
                )
            else:
                conversations.append([user, answer])
        return conversations

    def correct(self, *, completions: Sequence[Any], answer: Sequence[int], **kwargs) -> list[float]:
        """1.0 where the episode's last assistant message makes no tool call and its content is
        ``str(answer)`` (surrounding whitespace aside), else 0.0 (a reward function).

        A completion is a list of messages (a multi-turn episode) or a string (its one turn)."""
        return [
            float(_final_answer(completion) == str(int(a))) for completion, a in zip(completions, answer, strict=True)
        ]

    def calls(self, *, completions: Sequence[Any], **kwargs) -> list[float]:
        """Minus the number of tool results (``role == "tool"`` messages: every call answered,
        malformed ones included) in each episode (a reward function, weighted by ``call_cost``)."""
        return [
            -float(sum(_role(m) == "tool" for m in completion)) if not isinstance(completion, str) else 0.0
            for completion in completions
        ]

    def _draw(self, rng: np.random.Generator) -> tuple[int, int, bool]:
        """``(a, b, hard)``: one sum drawn from ``rng``."""
        if rng.random() >= self.hard_fraction:
            a, b = rng.integers(0, 10, size=2)
            return int(a), int(b), False
        fewest, most = self.hard_digits
        digits = rng.integers(fewest, most + 1, size=2)
        a, b = (int(rng.integers(10 ** (d - 1), 10**d)) for d in digits)
        return a, b, True

    def _render(self, messages: Sequence[Mapping[str, Any]], *, generation: bool) -> list[int]:
        return render_chat(self.tokenizer, messages, self.tools, generation_prompt=generation)


def sft_arrays(
    tokenizer: transformers.PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    *,
    tools: Sequence[Callable | dict] = (),
    pad_id: int | None = None,
    end_of_turn: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Conversations as the arrays of :func:`jaxrl_llm.training.supervised_finetune`, learning
    the assistant's tokens only.

    Each conversation is rendered by the tokenizer's chat template with ``tools``. Its prompt,
    everything before the first assistant message's content (the generation prompt included),
    is left-padded into the first ``S`` columns; the rest (assistant turns, and the tool results
    and generation prompts between them) follows, padded on the right to ``N``. An assistant
    message's tokens run from the end of the conversation before it, rendered with the
    generation prompt, to the end of the conversation through it, cut after its last
    ``end_of_turn`` (templates that write a newline after it: that belongs to what follows,
    as in an episode built by :func:`jaxrl_llm.episodes.conversation.tool_suffix_ids`).

    Args:
      tokenizer: a tokenizer with a prefix-preserving chat template.
      conversations: ``[D]`` lists of messages, each with at least one assistant message.
      tools: the tools whose schemas the prompt shows (as in the rollout's prompts).
      pad_id: the padding id; default the tokenizer's.
      end_of_turn: the id that ends an assistant turn; default the tokenizer's EOS.

    Returns:
      ``tokens`` ``[D, S + N]`` int32, ``attention_mask`` ``[D, S + N]`` bool (true on every
      real token, tool results included) and ``completion_mask`` ``[D, N]`` bool (true on the
      assistant's tokens: content, tool calls, end of turn).

    Raises:
      ValueError: a conversation has no assistant message or opens with one, or the template is not
        prefix-preserving (a conversation's prefix does not render as a prefix of it).
    """
    pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
    end_of_turn = tokenizer.eos_token_id if end_of_turn is None else end_of_turn
    if pad_id is None:
        raise ValueError("sft_arrays: the tokenizer has no pad token; pass `pad_id=`.")
    rows = []  # (prompt ids, rest ids, rest mask)
    for index, messages in enumerate(conversations):
        messages = [dict(m) for m in messages]
        full = render_chat(tokenizer, messages, tools, generation_prompt=False)
        spans = []
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            if k == 0:
                raise ValueError(
                    f"sft_arrays: conversation {index} opens with an assistant message; it needs a prompt (a user "
                    f"message) before the assistant's first turn."
                )
            start = render_chat(tokenizer, messages[:k], tools, generation_prompt=True)
            end = render_chat(tokenizer, messages[: k + 1], tools, generation_prompt=False)
            for part, head in ((start, k), (end, k + 1)):
                if full[: len(part)] != part:
                    raise ValueError(
                        f"sft_arrays: conversation {index}: the chat template is not prefix-preserving (its first "
                        f"{head} messages do not render as a prefix of the whole conversation), so its assistant "
                        f"tokens cannot be located; use a template that renders each message independently of the "
                        f"later ones."
                    )
            turn = end[len(start) :]
            if end_of_turn in turn:
                turn = turn[: len(turn) - turn[::-1].index(end_of_turn)]
            spans.append((len(start), len(start) + len(turn)))
        if not spans:
            raise ValueError(f"sft_arrays: conversation {index} has no assistant message to learn.")
        cut = spans[0][0]
        mask = np.zeros(len(full) - cut, bool)
        for begin, stop in spans:
            mask[begin - cut : stop - cut] = True
        rows.append((full[:cut], full[cut:], mask))
    if not rows:
        raise ValueError("sft_arrays: no conversations.")
    prompt_tokens, prompt_mask = left_pad([prompt for prompt, _, _ in rows], pad_id=pad_id)  # [D, S]
    width = max(len(rest) for _, rest, _ in rows)
    rest_tokens = np.full((len(rows), width), pad_id, np.int32)  # [D, N]
    rest_mask = np.zeros((len(rows), width), bool)
    completion_mask = np.zeros((len(rows), width), bool)
    for row, (_, rest, learned) in enumerate(rows):
        rest_tokens[row, : len(rest)] = rest
        rest_mask[row, : len(rest)] = True
        completion_mask[row, : len(rest)] = learned
    tokens = np.concatenate([prompt_tokens, rest_tokens], axis=1)
    attention_mask = np.concatenate([prompt_mask, rest_mask], axis=1)
    return tokens, attention_mask, completion_mask


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else None


def _text(content: Any) -> str | None:
    """A message's content as text (a string, or the text of ``{"type": "text"}`` parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return None


def _final_answer(completion: Any) -> str | None:
    """The stripped content of the episode's last assistant message, or ``None`` when it makes
    a tool call or there is none."""
    if isinstance(completion, str):
        return completion.strip()
    last = next((m for m in reversed(list(completion)) if _role(m) == "assistant"), None)
    if last is None or last.get("tool_calls"):
        return None
    text = _text(last.get("content"))
    return None if text is None else text.strip()


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and bool(np.isfinite(value))


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
