r"""The task interface: prompts with their columns, a tokenizer, stop ids and reward functions.

A task is anything with the attributes and methods of :class:`Task`. The trainer, the
evaluator and the CLI use nothing else, so a task is free to be a dataset on disk, a
procedural generator or a live environment.

.. code-block:: python

    batch = tasks.base.draw(task, "train", seed=0, start=0, count=8)
    batch.tokens   # [P, S] int32, left-padded
    batch.prompts  # [P] what reward functions receive as ``prompts``
    batch.columns  # {"answer": [P values], ...}: the other columns of the examples

**The prompt stream.** Example positions are addressable: the examples the trainer sees
at positions ``start .. start + count - 1`` of the stream seeded by ``seed`` are a
function of these numbers alone (:func:`stream_indices`), so a run resumed from its state
sees the prompts the uninterrupted run would have seen. A finite split is walked in
epochs without replacement, each epoch a fresh permutation; an unbounded (procedural)
split generates example ``i`` from ``(seed, i)``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import numbers
import os
import pathlib
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import transformers

SPLITS = ("train", "test")
"""The splits every task has."""

RewardFn = Callable[..., Sequence[float | None]]
"""A reward function in TRL's convention: called with keyword arguments only,
``fn(prompts=..., completions=..., completion_ids=..., **columns)``, it returns one
number (or ``None``: does not apply) per completion. See :mod:`jaxrl_llm.rewards`."""


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """``P`` prompts, tokenized, with the columns of their examples."""

    tokens: np.ndarray  # [P, S] int32: left-padded prompt ids (chat template applied)
    mask: np.ndarray  # [P, S] bool: true for real tokens
    prompts: list[Any]  # [P]: what reward functions receive as `prompts` (the prompt before templating)
    columns: dict[str, list[Any]]  # name -> [P] values: every other column of the examples
    indices: np.ndarray  # [P] int64: the examples' indices in their split

    def __post_init__(self):
        count = len(self.prompts)
        if self.tokens.shape != self.mask.shape or self.tokens.ndim != 2 or self.tokens.shape[0] != count:
            raise ValueError(
                f"PromptBatch: tokens {self.tokens.shape} and mask {self.mask.shape} must both be "
                f"[P, S] with P = {count} prompts."
            )
        if bad := {name: len(values) for name, values in self.columns.items() if len(values) != count}:
            raise ValueError(f"PromptBatch: every column needs one value per prompt ({count}); got lengths {bad}.")

    def __len__(self) -> int:
        return len(self.prompts)


@runtime_checkable
class Task(Protocol):
    """What :func:`jaxrl_llm.training.train` and :func:`jaxrl_llm.evaluation.evaluate` use.

    Attributes:
      tokenizer: a Hugging Face tokenizer; completions are decoded with it.
      eos_ids: every id that ends a completion (the tokenizer's EOS and the checkpoint's
        ``generation_config.eos_token_id``; :func:`special_ids`).
      pad_id: the id written after a completion's end.
      stop_strings: texts that also end a completion (may be empty).
      reward_fns: the reward functions, in TRL's convention (:data:`RewardFn`).
      reward_weights: one weight per reward function; the reward is
        :math:`r = \\sum_j w_j r_j` over the functions that apply.
    """

    tokenizer: transformers.PreTrainedTokenizerBase
    eos_ids: tuple[int, ...]
    pad_id: int
    stop_strings: tuple[str, ...]
    reward_fns: tuple[RewardFn, ...]
    reward_weights: tuple[float, ...]

    def split_size(self, split: str) -> int | None:
        """Examples in ``split`` (one of :data:`SPLITS`); ``None``: unbounded (procedural)."""

    def examples(self, split: str, indices: np.ndarray, *, seed: int) -> PromptBatch:
        """The examples at ``indices`` ``[P]`` of ``split``, in that order. An unbounded
        split generates example ``i`` from ``(seed, i)``; a finite one ignores ``seed``."""


def check_task(task: Any, *, needs_rewards: bool = True) -> None:
    """Raises TypeError or ValueError naming what makes ``task`` unusable as a :class:`Task`;
    without ``needs_rewards``, reward functions are not required (a run whose environments
    score the episodes with ``get_reward``, as TRL allows)."""
    missing = [
        name
        for name in (
            "tokenizer",
            "eos_ids",
            "pad_id",
            "stop_strings",
            "reward_fns",
            "reward_weights",
            "split_size",
            "examples",
        )
        if not hasattr(task, name)
    ]
    if missing:
        raise TypeError(
            f"{type(task).__name__} is not a Task: it lacks {', '.join(missing)} (see jaxrl_llm.tasks.Task)."
        )
    if needs_rewards and not task.reward_fns:
        raise ValueError(
            f"{type(task).__name__}: a task needs at least one reward function (or, in a run, an environment with "
            f"get_reward); got none."
        )
    if bad := [fn for fn in task.reward_fns if not callable(fn)]:
        raise TypeError(f"{type(task).__name__}: reward functions must be callable; got {bad!r}.")
    if len(task.reward_weights) != len(task.reward_fns):
        raise ValueError(
            f"{type(task).__name__}: {len(task.reward_weights)} reward weights for "
            f"{len(task.reward_fns)} reward functions; give one weight per function."
        )
    if bad := [w for w in task.reward_weights if not _finite(w)]:
        raise ValueError(f"{type(task).__name__}: reward weights must be finite numbers; got {bad!r}.")
    if not task.eos_ids or not all(_int(e) for e in task.eos_ids):
        raise ValueError(
            f"{type(task).__name__}: `eos_ids` must be a non-empty tuple of token ids; got {task.eos_ids!r}."
        )
    if not _int(task.pad_id):
        raise ValueError(f"{type(task).__name__}: `pad_id` must be a token id; got {task.pad_id!r}.")
    if isinstance(task.stop_strings, str):
        raise ValueError(
            f"{type(task).__name__}: `stop_strings` must be a tuple of strings, not one string; "
            f"got {task.stop_strings!r}."
        )
    if bad := [s for s in task.stop_strings if not isinstance(s, str) or not s]:
        raise ValueError(f"{type(task).__name__}: stop strings must be non-empty strings; got {bad!r}.")


def _int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and bool(np.isfinite(value))


def stream_indices(size: int | None, *, seed: int, start: int, count: int) -> np.ndarray:
    """``[count]`` example indices at positions ``start .. start + count - 1`` of the stream.

    A split of ``size`` examples is walked in epochs of ``size`` positions, each a
    permutation drawn from ``(seed, epoch)``: every example once per epoch, in a fresh
    order. An unbounded split (``size=None``) maps position ``i`` to example ``i``.
    """
    positions = np.arange(start, start + count, dtype=np.int64)
    if size is None:
        return positions
    if size < 1:
        raise ValueError("stream_indices: the split has no examples.")
    epochs = positions // size
    indices = np.empty(count, np.int64)
    for epoch in np.unique(epochs):
        chosen = epochs == epoch
        indices[chosen] = np.random.default_rng((seed, int(epoch))).permutation(size)[positions[chosen] % size]
    return indices


def check_split(split: str) -> None:
    """Raises ValueError unless ``split`` is one of :data:`SPLITS`."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; a task has {SPLITS}.")


def draw(task: Task, split: str, *, seed: int, start: int, count: int) -> PromptBatch:
    """The ``count`` examples at positions ``start ..`` of ``split``'s stream seeded by ``seed``."""
    check_split(split)
    indices = stream_indices(task.split_size(split), seed=seed, start=start, count=count)
    batch = task.examples(split, indices, seed=seed)
    if len(batch) != count:
        raise ValueError(f"{type(task).__name__}.examples returned {len(batch)} examples for {count} indices.")
    return batch


def encode_prompts(
    tokenizer: transformers.PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    pad_id: int,
    add_special_tokens: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes ``texts`` into left-padded ``tokens`` ``[P, S]`` int32 and ``mask`` ``[P, S]``
    bool, whatever the tokenizer's ``padding_side``. ``S`` is the longest prompt."""
    if not texts:
        return np.zeros((0, 0), np.int32), np.zeros((0, 0), bool)
    encoded = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    if empty := [i for i, ids in enumerate(encoded) if not ids]:
        raise ValueError(f"Prompt {empty[0]} encodes to no tokens: {texts[empty[0]]!r}.")
    return left_pad(encoded, pad_id=pad_id)


def left_pad(rows: Sequence[Sequence[int]], *, pad_id: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists as ``tokens`` ``[P, W]`` int32 and ``mask`` ``[P, W]`` bool, each row
    right-aligned after ``pad_id`` padding; ``W`` is ``width``, or the longest row."""
    width = max((len(ids) for ids in rows), default=0) if width is None else width
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for row, ids in enumerate(rows):
        if len(ids):
            tokens[row, width - len(ids) :] = ids
            mask[row, width - len(ids) :] = True
    return tokens, mask


def render_chat(
    tokenizer: transformers.PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] = (),
    *,
    generation_prompt: bool,
) -> list[int]:
    """The ids of ``messages`` by the tokenizer's chat template, with ``tools``' schemas
    (none: ``tools=None``, as TRL passes them, since some templates render tool
    boilerplate for ``tools=[]``), ending with the start of an assistant turn when
    ``generation_prompt``."""
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[tool_schema(tool) for tool in tools] or None,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding or a list, by version and arguments
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        (ids,) = ids
    return [int(i) for i in ids]


def tool_schema(tool: Any) -> Any:
    """The JSON schema a chat template shows for ``tool``: ``transformers.utils.get_json_schema``
    of a function or bound method, computed once per function (it parses the docstring and
    the type hints, which transformers does again for every conversation it renders) and
    shared, so not to be modified; a schema given as a dict as it is.

    A bound method's schema leaves out ``self``, so all of a class's instances share it (an
    environment's tools, whose instance is new each episode).

    Raises:
      TypeError: ``tool`` is none of these (transformers renders no other).
    """
    if isinstance(tool, Mapping):
        return tool
    function = tool.__func__ if inspect.ismethod(tool) else tool if inspect.isfunction(tool) else None
    if function is None:
        raise TypeError(f"a tool is a function, a bound method or a JSON schema dict; got {type(tool).__name__}")
    schema = _TOOL_SCHEMAS.get(function)
    if schema is None:
        schema = _TOOL_SCHEMAS[function] = transformers.utils.get_json_schema(tool)
    return schema


_TOOL_SCHEMAS: weakref.WeakKeyDictionary[Callable, dict] = weakref.WeakKeyDictionary()


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, Iterable) and not isinstance(value, str) else [value])]


def special_ids(
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    eos_ids: int | Iterable[int] | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> tuple[tuple[int, ...], int]:
    """``(eos_ids, pad_id)`` for ``tokenizer``.

    The stop ids are all of: ``eos_ids`` when given, else the tokenizer's EOS and the
    ``eos_token_id`` (an int or a list) of ``generation_config.json`` in ``checkpoint``,
    or in the tokenizer's own directory when it was loaded from one (chat models stop
    on an end-of-turn token that is often not the tokenizer's EOS). The pad id is the
    tokenizer's, or, when it has none, the first stop id (what is written after a
    completion's end is never read, so any id serves).

    Raises:
      ValueError: when no stop id is found; pass ``eos_ids``.
    """
    found = _id_list(eos_ids)
    if not found:
        found = _id_list(tokenizer.eos_token_id)
        for directory in (checkpoint, getattr(tokenizer, "name_or_path", None)):
            config = pathlib.Path(directory) / "generation_config.json" if directory else None
            if config is not None and config.is_file():
                found += _id_list(json.loads(config.read_text()).get("eos_token_id"))
                break
    found = list(dict.fromkeys(found))
    if not found:
        raise ValueError(
            "The tokenizer has no EOS token and no generation_config.json names one, so completions could never "
            "end; pass `eos_ids=` (the id or ids that end a completion)."
        )
    pad_id = tokenizer.pad_token_id
    return tuple(found), found[0] if pad_id is None else int(pad_id)


def columns_of(records: Sequence[Mapping[str, Any]], names: Iterable[str]) -> dict[str, list[Any]]:
    """``{name: [value of each record]}`` for the given column names."""
    return {name: [record.get(name) for record in records] for name in names}


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest token string:
    a byte-level token's string has a character per byte, a byte-fallback token's
    ``<0xNN>`` six), so that a text of ``n`` characters takes at least
    ``n / longest_token_chars`` tokens: a bound that spares tokenizing what cannot fit
    (a prompt, a tool result). Kept per tokenizer while its vocabulary's size stays: a
    rollout asks every step."""
    size = len(tokenizer)
    cached = _LONGEST_TOKEN_CHARS.get(tokenizer)
    if cached is None or cached[0] != size:
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        cached = (size, max(len(token) for token in tokens if token is not None))
        _LONGEST_TOKEN_CHARS[tokenizer] = cached
    return cached[1]


_LONGEST_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (size, chars)
