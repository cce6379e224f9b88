r"""Text tasks: examples that are records (dicts), a prompt, a tokenizer and reward functions.

:class:`TextTask` is the :class:`~jaxrl_llm.tasks.base.Task` of every text source here:
a list of records, a JSON-lines file (:func:`from_jsonl`), a local ``datasets`` dataset or
Parquet/Arrow file (:func:`from_dataset`), or a procedural generator (the arithmetic and
reasoning-gym tasks). A record is one example, e.g.

.. code-block:: python

    {"question": "What is 2 + 2?", "answer": "4"}

and the task turns it into what the trainer needs:

* **the prompt**: ``prompt`` names a column (``"question"``), or, when it contains a
  ``{``, is a format string over the columns (``"Solve {question}"``; ``{{``/``}}`` are
  literal braces). A column's value is a string or a conversation in TRL's format,
  ``[{"role": "user", "content": "..."}, ...]``.
* **the model's input**: with a chat template (the tokenizer's, when it has one), the
  prompt becomes ``[system?, user]`` messages (a conversation is used as it is, after the
  system message unless it has its own), rendered by
  ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
  **chat_template_kwargs)`` and encoded without adding special tokens (the template wrote
  them). Without one, the text is the prompt, or ``plain_template`` filled with
  ``{system}`` and ``{prompt}`` when there is a system prompt, encoded with the
  tokenizer's special tokens (its BOS, if it adds one).
* **the reward functions' arguments** (TRL's convention): ``prompts`` are the prompts as
  the records (or the format string) give them, *before* templating, and every other
  column of the records is passed under its own name (``answer=[...]``), one value per
  completion.

.. code-block:: python

    task = from_jsonl("train.jsonl", tokenizer=tokenizer, prompt="question",
                      reward_fns=[rewards.text.exact_match], test_fraction=0.1)
    batch = tasks.base.draw(task, "train", seed=0, start=0, count=8)   # a PromptBatch
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import pathlib
import string
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import transformers

from jaxrl_llm.rewards.combine import ARGUMENTS
from jaxrl_llm.tasks.base import (
    SPLITS,
    PromptBatch,
    RewardFn,
    check_split,
    check_task,
    columns_of,
    encode_prompts,
    special_ids,
)

PLAIN_TEMPLATE = "{system}\n\n{prompt}"
"""How a prompt and a system prompt are joined when there is no chat template."""

RESERVED_COLUMNS = ARGUMENTS
"""Argument names of reward functions that a column may not take."""

Record = Mapping[str, Any]
"""One example: column name -> value."""

ExampleFn = Callable[[str, int, int], Record]
"""A procedural source: ``example(split, index, seed) -> record``."""

_DATASETS_EXTRA = "pip install 'jaxrl_llm[datasets]'"


def _fail(message: str) -> ValueError:
    return ValueError(f"TextTask: {message}")


def _listing(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(repr(n) for n in names) if names else "(none)"


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )


def format_fields(fmt: str, *, what: str) -> list[str]:
    """The root names of the fields of format string ``fmt`` (``{a.b[0]}`` -> ``a``)."""
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError as error:
        raise _fail(
            f"{what} {fmt!r} is not a valid format string ({error}); write literal braces as '{{{{' and '}}}}'."
        ) from None
    fields = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise _fail(f"{what} {fmt!r} has a positional field {{{field}}}; name a column, e.g. '{{question}}'.")
        fields.append(root)
    return list(dict.fromkeys(fields))


class _Subset(Sequence):
    """The records of ``base`` at ``indices``, without copying them."""

    def __init__(self, base: Sequence[Record], indices: Sequence[int]):
        self.base, self.indices = base, [int(i) for i in indices]
        if (names := getattr(base, "column_names", None)) is not None:
            self.column_names = list(names)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.base[i] for i in self.indices[index]]
        return self.base[self.indices[index]]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TextTask:
    """A :class:`~jaxrl_llm.tasks.base.Task` over records: finite per-split lists, or a
    procedural generator.

    Build one with :func:`from_records`, :func:`from_jsonl`, :func:`from_dataset`, or
    directly. Everything is checked at construction, on the first record of each split
    (and, for record lists, the column names of every record), so a wrong column name
    fails now, not at step 500. ``dataclasses.replace(task, reward_fns=...)`` gives a
    task with other settings, checked again; the settings resolved at construction
    (``eos_ids``, ``pad_id``, ``chat_template``) carry over, so pass them again with a
    new tokenizer.

    Attributes:
      tokenizer: a Hugging Face tokenizer.
      reward_fns: one or more reward functions in TRL's convention (a single callable is
        accepted).
      reward_weights: one weight per function; default 1.0 each.
      records: ``{"train": records, "test": records}``: each a sequence of dicts (a list,
        or anything with ``len`` and integer indexing, such as a ``datasets.Dataset``). A
        missing split is empty. Give this or ``example``.
      example: a procedural source, ``example(split, index, seed) -> dict``, with
        ``sizes``. For a finite split the record must depend on ``(split, index)`` alone
        (a finite split ignores the stream's seed); an unbounded one draws example
        ``index`` from ``(seed, index)``.
      sizes: with ``example``: ``{"train": n or None, "test": n or None}`` (``None``:
        unbounded; a missing split is empty).
      prompt: a column name, or (when it contains ``{``) a format string over the columns.
      system_prompt: prepended as a system message (chat template) or through
        ``plain_template``; a conversation that starts with its own system message keeps it.
      chat_template: ``None`` (default): use the tokenizer's chat template when it has
        one; ``True``: require it; ``False``: never. Resolved to a bool.
      chat_template_kwargs: extra arguments of ``apply_chat_template``, e.g.
        ``{"enable_thinking": False}`` for Qwen3.
      plain_template: without a chat template, how a system prompt joins the prompt:
        a format string with ``{prompt}`` and optionally ``{system}`` (default
        :data:`PLAIN_TEMPLATE`). Without a system prompt the prompt is used as it is.
      eos_ids, checkpoint: the stop ids, or ``None`` to find them
        (:func:`~jaxrl_llm.tasks.base.special_ids`: the tokenizer's EOS and the
        ``generation_config.json`` of ``checkpoint`` or of the tokenizer's directory).
        Resolved to a tuple.
      pad_id: ``None``: the tokenizer's pad id, or the first stop id when it has none.
      stop_strings: texts that also end a completion.
    """

    tokenizer: transformers.PreTrainedTokenizerBase = dataclasses.field(repr=False)
    reward_fns: tuple[RewardFn, ...]
    reward_weights: tuple[float, ...] | None = None
    records: Mapping[str, Sequence[Record]] | None = dataclasses.field(default=None, repr=False)
    example: ExampleFn | None = None
    sizes: Mapping[str, int | None] | None = None
    prompt: str = "prompt"
    system_prompt: str | None = None
    chat_template: bool | None = None
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    plain_template: str = PLAIN_TEMPLATE
    eos_ids: tuple[int, ...] | int | None = None
    pad_id: int | None = None
    checkpoint: str | os.PathLike | None = None
    stop_strings: tuple[str, ...] = ()
    columns: tuple[str, ...] = dataclasses.field(init=False)
    """The columns reward functions receive (besides ``prompts``), fixed at construction."""
    environment_prompts: bool = dataclasses.field(init=False)
    """The dataset has no prompt column (a dataset with only an ``environment`` column, or
    none, as TRL allows): each example's prompt is an empty user message, which an
    environment's ``reset()`` fills. A run without environments refuses such a task."""

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        fns = self.reward_fns
        fns = (fns,) if callable(fns) else tuple(fns)
        set_("reward_fns", fns)
        weights = (1.0,) * len(fns) if self.reward_weights is None else self.reward_weights
        if isinstance(weights, numbers.Real):
            weights = (weights,)
        set_(
            "reward_weights",
            tuple(float(w) if isinstance(w, numbers.Real) and not isinstance(w, bool) else w for w in weights),
        )
        set_("stop_strings", (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings))
        eos_ids, pad_id = special_ids(self.tokenizer, eos_ids=self.eos_ids, checkpoint=self.checkpoint)
        set_("eos_ids", eos_ids)
        set_("pad_id", pad_id if self.pad_id is None else self.pad_id)
        check_task(self, needs_rewards=False)  # a run checks again: its environments may score instead
        self._check_sources(set_)
        self._check_templates(set_)
        self._check_columns(set_)
        for split in SPLITS:  # render and encode the first example of each split now
            if self.split_size(split) != 0:
                self.examples(split, np.zeros(1, np.int64), seed=0)

    def _check_sources(self, set_) -> None:
        if (self.records is None) == (self.example is None):
            raise _fail(
                "give exactly one of `records` (per-split lists of dicts) and `example` (a generator "
                f"example(split, index, seed) with `sizes`); got {'both' if self.example else 'neither'}."
            )
        given = self.records if self.records is not None else self.sizes
        if self.example is not None:
            if not callable(self.example):
                raise TypeError(
                    f"TextTask: `example` must be callable as example(split, index, seed); "
                    f"got {type(self.example).__name__}."
                )
            if not isinstance(self.sizes, Mapping):
                raise _fail(
                    "a procedural `example` needs `sizes`, e.g. {'train': None, 'test': 500} "
                    f"(None: unbounded); got {self.sizes!r}."
                )
        elif self.sizes is not None:
            raise _fail("`sizes` goes with `example`; the sizes of `records` are their lengths.")
        if not isinstance(given, Mapping):
            raise _fail(f"`records` must map split names {SPLITS} to sequences of dicts; got {type(given).__name__}.")
        if unknown := [s for s in given if s not in SPLITS]:
            raise _fail(f"unknown split(s) {_listing(unknown)}; a task has {SPLITS}.")
        if self.records is not None:
            records = {}
            for split in SPLITS:
                value = self.records.get(split, ())
                if isinstance(value, (str, bytes, Mapping)) or not (
                    hasattr(value, "__len__") and hasattr(value, "__getitem__")
                ):
                    raise _fail(
                        f"records[{split!r}] must be a sequence of dicts (one per example); got {type(value).__name__}."
                    )
                records[split] = value
            set_("records", records)
        else:
            sizes = {}
            for split in SPLITS:
                size = self.sizes.get(split, 0)
                if size is not None and not (
                    isinstance(size, numbers.Integral) and not isinstance(size, bool) and size >= 0
                ):
                    raise _fail(f"sizes[{split!r}] must be a count >= 0 or None (unbounded); got {size!r}.")
                sizes[split] = None if size is None else int(size)
            set_("sizes", sizes)
        if self.split_size("train") == 0:
            raise _fail("the train split has no examples.")

    def _check_templates(self, set_) -> None:
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if self.chat_template not in (None, True, False):
            raise _fail(
                f"`chat_template` must be None (use the tokenizer's when it has one), True or False; "
                f"got {self.chat_template!r}."
            )
        if self.chat_template and not has_template:
            raise _fail(
                "chat_template=True, but the tokenizer has no chat template; set `tokenizer.chat_template` "
                "(a Jinja string), or pass chat_template=False to use `plain_template`."
            )
        set_("chat_template", has_template if self.chat_template is None else bool(self.chat_template))
        if not isinstance(self.chat_template_kwargs, Mapping):
            raise TypeError(
                f"TextTask: `chat_template_kwargs` must be a dict; got {type(self.chat_template_kwargs).__name__}."
            )
        set_("chat_template_kwargs", dict(self.chat_template_kwargs))
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise TypeError(
                f"TextTask: `system_prompt` must be a str or None; got {type(self.system_prompt).__name__}."
            )
        if not isinstance(self.plain_template, str):
            raise TypeError(f"TextTask: `plain_template` must be a str; got {type(self.plain_template).__name__}.")
        fields = format_fields(self.plain_template, what="`plain_template`")
        if "prompt" not in fields or set(fields) - {"system", "prompt"}:
            raise _fail(
                f"`plain_template` must contain '{{prompt}}' and may contain '{{system}}', nothing else; "
                f"got {self.plain_template!r}."
            )
        if not isinstance(self.prompt, str) or not self.prompt:
            raise TypeError(f"TextTask: `prompt` must be a column name or a format string; got {self.prompt!r}.")

    def _check_columns(self, set_) -> None:
        names: dict[str, None] = {}
        for split in SPLITS:
            if self.records is not None:
                required = format_fields(self.prompt, what="the prompt format") if self.is_format else [self.prompt]
                names.update(dict.fromkeys(_column_names(self.records[split], split, required)))
            elif self.split_size(split) != 0:
                names.update(dict.fromkeys(self._record(split, 0, 0)))
        if clash := [n for n in names if n in RESERVED_COLUMNS]:
            raise _fail(
                f"column(s) {_listing(clash)} would collide with the reward functions' own arguments "
                f"{RESERVED_COLUMNS}; rename them."
            )
        if self.is_format:
            fields = format_fields(self.prompt, what="the prompt format")
            if missing := [f for f in fields if f not in names]:
                raise _fail(
                    f"the prompt format {self.prompt!r} uses column(s) {_listing(missing)}, which the "
                    f"dataset does not have; its columns are {_listing(names)}."
                )
            set_("columns", tuple(names))
        else:
            missing = self.prompt not in names
            if missing and not self.chat_template:
                raise _fail(
                    f"{self.missing_prompt_message(names)} (Without one, an environment's reset() gives the prompt: "
                    f"a conversation, which needs a chat template, and the task uses none.)"
                )
            set_("columns", tuple(n for n in names if n != self.prompt))
        set_("environment_prompts", not self.is_format and self.prompt not in names)

    def missing_prompt_message(self, names: Iterable[str] | None = None) -> str:
        """Why a task without its prompt column cannot run without environments (no period)."""
        names = self.columns if names is None else names
        return (
            f"no prompt column {self.prompt!r}; the dataset's columns are {_listing(names)}. Pass `prompt=` a "
            f"column name, or a format string such as 'Solve {{question}}'"
        )

    @property
    def is_format(self) -> bool:
        """Whether :attr:`prompt` is a format string (it contains ``{``) rather than a column name."""
        return "{" in self.prompt

    def split_size(self, split: str) -> int | None:
        """Examples in ``split``; ``None``: unbounded (a procedural split)."""
        check_split(split)
        if self.records is not None:
            return len(self.records[split])
        return self.sizes[split]

    def _record(self, split: str, index: int, seed: int) -> Record:
        record = self.records[split][index] if self.records is not None else self.example(split, index, seed)
        if not isinstance(record, Mapping):
            raise TypeError(
                f"TextTask: example {index} of the {split} split is a {type(record).__name__}, not a dict of columns."
            )
        return record

    def _prompt_of(self, record: Record, split: str, index: int) -> str | list[dict[str, Any]]:
        where = f"example {index} of the {split} split"
        if self.is_format:
            try:
                return self.prompt.format(**record)
            except (KeyError, IndexError, AttributeError) as error:
                raise _fail(
                    f"the prompt format {self.prompt!r} failed on {where} ({type(error).__name__}: {error}); "
                    f"its columns are {_listing(record)}."
                ) from None
        if self.environment_prompts:
            return [{"role": "user", "content": ""}]  # TRL's: the environment's reset() gives the prompt
        if self.prompt not in record:
            raise _fail(f"{where} has no prompt column {self.prompt!r}; its columns are {_listing(record)}.")
        value = record[self.prompt]
        if isinstance(value, str):
            if not value:
                raise _fail(f"the prompt of {where} is empty.")
            return value
        if _is_conversation(value):
            if not self.chat_template:
                raise _fail(
                    f"the prompt of {where} is a conversation (a list of messages), which needs a chat "
                    "template, and the task uses none (the tokenizer has none, or chat_template=False)."
                )
            return [dict(m) for m in value]
        raise _fail(
            f"the prompt column {self.prompt!r} of {where} must hold a string or a conversation "
            f"[{{'role': ..., 'content': ...}}, ...]; got {value!r:.120}."
        )

    def check_prompts(self, split: str, *, max_characters: int | None = None) -> None:
        """Reads every prompt of a finite ``split`` (one record at a time) before any compute:
        raises ValueError naming the first example whose prompt is not a string or a
        conversation, or, with ``max_characters``, has more characters than that (the
        prompt length limit times the most characters a token stands for: it cannot fit,
        and tokenizing it first could take gigabytes). A procedural split is skipped."""
        size = self.split_size(split)
        if size is None or self.environment_prompts:
            return
        for index in range(size):
            prompt = self._prompt_of(self._record(split, index, 0), split, index)
            if max_characters is None:
                continue
            characters = (
                len(prompt)
                if isinstance(prompt, str)
                else sum(len(m.get("content")) for m in prompt if isinstance(m.get("content"), str))
            )
            if characters > max_characters:
                raise _fail(
                    f"the prompt of example {index} of the {split} split has {characters:,} characters, more than "
                    f"max_prompt_length tokens can hold ({max_characters:,} characters at most); shorten it or drop "
                    f"the example, or raise max_prompt_length."
                )

    def render(self, prompt: str | Sequence[Mapping[str, str]]) -> str:
        """The text the model reads for ``prompt`` (a string or a conversation): the chat
        template with the system prompt, or the plain template."""
        if self.chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            if self.system_prompt is not None and messages[0].get("role") != "system":
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
            )
            if not isinstance(text, str):
                raise TypeError(
                    f"TextTask: apply_chat_template(tokenize=False) returned {type(text).__name__}, not a str."
                )
            return text
        if not isinstance(prompt, str):
            raise _fail("a conversation needs a chat template; the task uses none.")
        return (
            prompt
            if self.system_prompt is None
            else self.plain_template.format(system=self.system_prompt, prompt=prompt)
        )

    def examples(self, split: str, indices: np.ndarray, *, seed: int) -> PromptBatch:
        """The examples at ``indices`` ``[P]`` of ``split``: tokens left-padded, ``prompts``
        before templating, and :attr:`columns`."""
        records, prompts, indices = self._gather(split, indices, seed)
        if not records:
            return PromptBatch(
                tokens=np.zeros((0, 0), np.int32),
                mask=np.zeros((0, 0), bool),
                prompts=[],
                columns={name: [] for name in self.columns},
                indices=indices,
            )
        tokens, mask = encode_prompts(
            self.tokenizer,
            [self.render(p) for p in prompts],
            pad_id=self.pad_id,
            add_special_tokens=not self.chat_template,
        )
        return PromptBatch(
            tokens=tokens, mask=mask, prompts=prompts, columns=self._columns_of(records), indices=indices
        )

    def _gather(self, split: str, indices: np.ndarray, seed: int) -> tuple[list[Record], list[Any], np.ndarray]:
        check_split(split)
        indices = np.asarray(indices)
        if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
            raise ValueError(
                f"TextTask.examples: `indices` must be a [P] integer array; got {indices.dtype} {indices.shape}."
            )
        indices = indices.astype(np.int64)
        size = self.split_size(split)
        if indices.size and (indices.min() < 0 or (size is not None and indices.max() >= size)):
            bad = int(indices[(indices < 0) | (indices >= (size if size is not None else np.inf))][0])
            raise IndexError(
                f"TextTask.examples: index {bad} is outside the {split} split "
                f"({'unbounded' if size is None else f'{size} examples'})."
            )
        records = [self._record(split, int(i), seed) for i in indices]
        prompts = [self._prompt_of(r, split, int(i)) for r, i in zip(records, indices, strict=True)]
        return records, prompts, indices

    def _columns_of(self, records: Sequence[Record]) -> dict[str, list[Any]]:
        names = dict.fromkeys(self.columns)
        for record in records:  # a column only some records have (a generator's extra) is kept too
            names.update(dict.fromkeys(k for k in record if k not in names))
        if not self.is_format:
            names.pop(self.prompt, None)
        return columns_of(records, names)

    def demonstrations(
        self,
        split: str,
        indices: np.ndarray,
        *,
        completion: str | Callable[[Record], str],
        max_new_tokens: int,
        seed: int = 0,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Solved examples for a supervised warm start
        (:func:`jaxrl_llm.training.supervised_finetune`).

        Each row is the prompt (left-padded, as :meth:`examples` encodes it), then the
        completion's tokens (encoded without special tokens), the first of :attr:`eos_ids`
        and padding.

        Args:
          split, indices, seed: the examples, as for :meth:`examples`.
          completion: the column holding each example's target completion, or a function
            ``record -> str`` (the record holds every column, the prompt column included).
          max_new_tokens: ``N``; every completion and its EOS must fit.

        Returns:
          ``tokens`` ``[D, S + N]`` int32, ``attention_mask`` ``[D, S + N]`` bool and
          ``completion_mask`` ``[D, N]`` bool (the completion and its EOS).
        """
        if not (isinstance(max_new_tokens, numbers.Integral) and max_new_tokens >= 1):
            raise ValueError(f"demonstrations: `max_new_tokens` must be a positive int; got {max_new_tokens!r}.")
        batch = self.examples(split, indices, seed=seed)
        if isinstance(completion, str):
            if completion not in batch.columns:
                raise _fail(
                    f"demonstrations: no completion column {completion!r}; the columns are {_listing(batch.columns)}."
                )
            texts = batch.columns[completion]
        elif callable(completion):
            texts = []
            for row in range(len(batch)):
                record = {name: values[row] for name, values in batch.columns.items()}
                if not self.is_format:
                    record[self.prompt] = batch.prompts[row]
                texts.append(completion(record))
        else:
            raise TypeError(
                f"demonstrations: `completion` must be a column name or a function record -> str; got "
                f"{type(completion).__name__}."
            )
        count = len(batch)
        completion_ids = np.full((count, max_new_tokens), self.pad_id, np.int32)
        completion_mask = np.zeros((count, max_new_tokens), bool)
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(
                    f"demonstrations: the completion of example {int(batch.indices[row])} is a "
                    f"{type(text).__name__}, not a str."
                )
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.eos_ids[0]]
            if len(ids) > max_new_tokens:
                raise ValueError(
                    f"demonstrations: the completion of example {int(batch.indices[row])} of the {split} "
                    f"split takes {len(ids)} tokens with its EOS, more than max_new_tokens="
                    f"{max_new_tokens}: {text!r:.80}"
                )
            completion_ids[row, : len(ids)] = ids
            completion_mask[row, : len(ids)] = True
        tokens = np.concatenate([batch.tokens, completion_ids], axis=1)  # [D, S + N]
        attention_mask = np.concatenate([batch.mask, completion_mask], axis=1)  # [D, S + N]
        return tokens, attention_mask, completion_mask


def _column_names(records: Sequence[Record], split: str, required: Sequence[str] = ()) -> list[str]:
    """The columns of ``records``: a ``datasets.Dataset``'s ``column_names``, or the union
    of every record's keys, checking that each record is a dict with the ``required``
    columns (the prompt's)."""
    names = getattr(records, "column_names", None)
    if names is not None:
        return list(names)
    seen: dict[str, None] = {}
    for index in range(len(records)):
        record = records[index]
        if not isinstance(record, Mapping):
            raise TypeError(
                f"TextTask: example {index} of the {split} split is a {type(record).__name__}, not a dict of columns."
            )
        seen.update(dict.fromkeys(record))
    for index in range(len(records)):  # a column some records have and others lack would fail mid-run
        if missing := [name for name in required if name in seen and name not in records[index]]:
            raise _fail(
                f"example {index} of the {split} split has no {_listing(missing)} column for the prompt; "
                f"its columns are {_listing(records[index])}."
            )
    for name in seen:
        if lacking := sum(name not in records[index] for index in range(len(records))):
            warnings.warn(
                f"TextTask: column {name!r} is missing from {lacking} of {len(records)} examples of the "
                f"{split} split; reward functions receive None there.",
                stacklevel=3,
            )
    return list(seen)


_SETTINGS = tuple(
    f.name for f in dataclasses.fields(TextTask) if f.init and f.name not in ("records", "example", "sizes")
)


def task_options(fn: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as a dict, after checking each is a :class:`TextTask` option; ``fn`` names the caller.

    Raises:
      TypeError: an unknown option (the error lists the known ones).
    """
    if unknown := [name for name in settings if name not in _SETTINGS]:
        raise TypeError(f"{fn}: unknown option(s) {_listing(unknown)}; the TextTask options are {_listing(_SETTINGS)}.")
    return dict(settings)


def _sequence(fn: str, name: str, records: Any) -> Sequence[Record]:
    if isinstance(records, (str, bytes, os.PathLike, Mapping)):
        raise TypeError(
            f"{fn}: `{name}` must be a sequence of dicts (one per example); got {type(records).__name__}"
            + (" (for a file use from_jsonl or from_dataset)" if isinstance(records, (str, os.PathLike)) else "")
            + "."
        )
    if hasattr(records, "__len__") and hasattr(records, "__getitem__"):
        return records
    if isinstance(records, Iterable):
        return list(records)
    raise TypeError(f"{fn}: `{name}` must be a sequence of dicts (one per example); got {type(records).__name__}.")


def environment_task(
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    eos_ids: tuple[int, ...] | int | None = None,
    checkpoint: str | os.PathLike | None = None,
    system_prompt: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> TextTask:
    """The task of a run whose environment owns the data (TRL: ``GRPOTrainer`` without a
    ``train_dataset``): an endless train split of examples without columns, whose prompts
    are empty user messages that each episode's ``reset()`` fills; no test split, and no
    reward functions (the environment's ``get_reward`` scores). ``tokenizer`` needs a
    chat template (TRL's ``processing_class``)."""
    return TextTask(
        tokenizer=tokenizer,
        reward_fns=(),
        example=lambda split, index, seed: {},
        sizes={"train": None, "test": 0},
        system_prompt=system_prompt,
        chat_template=True,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        eos_ids=eos_ids,
        checkpoint=checkpoint,
    )


def from_records(
    records: Sequence[Record] | Iterable[Record],
    *,
    tokenizer: transformers.PreTrainedTokenizerBase,
    reward_fns: RewardFn | Sequence[RewardFn],
    prompt: str = "prompt",
    test_records: Sequence[Record] | Iterable[Record] | None = None,
    test_fraction: float = 0.0,
    split_seed: int = 0,
    **settings: Any,
) -> TextTask:
    """A :class:`TextTask` over a list of records.

    Args:
      records: the examples, dicts of columns (or anything with ``len`` and integer
        indexing, e.g. a ``datasets.Dataset``; an iterator is read into a list).
      tokenizer, reward_fns, prompt: see :class:`TextTask`.
      test_records: the test split. Without it, ``test_fraction`` of ``records`` (at least
        one) is held out, chosen by a permutation seeded by ``split_seed`` (both splits
        keep the records' order); with neither, the test split is empty.
      **settings: the other :class:`TextTask` options (``reward_weights``,
        ``system_prompt``, ``chat_template``, ``chat_template_kwargs``, ``plain_template``,
        ``eos_ids``, ``pad_id``, ``checkpoint``, ``stop_strings``).
    """
    fn = "from_records"
    settings = task_options(fn, settings)
    records = _sequence(fn, "records", records)
    if not len(records):
        raise ValueError(f"{fn}: `records` is empty; a task needs training examples.")
    if not (isinstance(test_fraction, numbers.Real) and 0.0 <= test_fraction < 1.0):
        raise ValueError(f"{fn}: `test_fraction` must be in [0, 1); got {test_fraction!r}.")
    if test_records is not None and test_fraction:
        raise ValueError(f"{fn}: give `test_records` or `test_fraction`, not both.")
    if test_records is not None:
        train, test = records, _sequence(fn, "test_records", test_records)
    elif test_fraction:
        count = len(records)
        held_out = max(1, round(test_fraction * count))
        if held_out >= count:
            raise ValueError(f"{fn}: test_fraction={test_fraction} of {count} records leaves no training examples.")
        order = np.random.default_rng(split_seed).permutation(count)
        train, test = _Subset(records, np.sort(order[held_out:])), _Subset(records, np.sort(order[:held_out]))
    else:
        train, test = records, []
    return TextTask(
        tokenizer=tokenizer, reward_fns=reward_fns, prompt=prompt, records={"train": train, "test": test}, **settings
    )


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file: one JSON object per line, blank lines skipped.

    Raises:
      ValueError: naming ``file:line`` for a line that is not UTF-8, not JSON or not an object.
    """
    path = pathlib.Path(path)
    records = []
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: not UTF-8 text ({error.reason} at byte {error.start} of the "
                    "line); save the file as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}): {line.strip()!r:.120}"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{number}: each line must be a JSON object (one example); got "
                    f"{type(record).__name__}: {line.strip()!r:.120}"
                )
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no examples (the file is empty).")
    return records


def from_jsonl(
    path: str | os.PathLike,
    *,
    tokenizer: transformers.PreTrainedTokenizerBase,
    reward_fns: RewardFn | Sequence[RewardFn],
    prompt: str = "prompt",
    test_path: str | os.PathLike | None = None,
    test_fraction: float = 0.0,
    split_seed: int = 0,
    **settings: Any,
) -> TextTask:
    """A :class:`TextTask` over a JSON-lines file (:func:`read_jsonl`); the test split is
    ``test_path``'s records, or a held-out ``test_fraction`` (see :func:`from_records`)."""
    test = read_jsonl(test_path) if test_path is not None else None
    return from_records(
        read_jsonl(path),
        tokenizer=tokenizer,
        reward_fns=reward_fns,
        prompt=prompt,
        test_records=test,
        test_fraction=test_fraction,
        split_seed=split_seed,
        **settings,
    )


def _import_datasets():
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"from_dataset needs the `datasets` package: {_DATASETS_EXTRA}.") from error
    return datasets


def load_dataset_source(source: Any) -> Any:
    """``source`` as a ``datasets.Dataset`` or ``DatasetDict``: a dataset is returned as
    is; a path is read from disk (a ``.parquet`` file, an ``.arrow`` file, or a directory
    written by ``save_to_disk``). Nothing is downloaded."""
    datasets = _import_datasets()
    if isinstance(source, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise TypeError(
            "from_dataset: streaming (iterable) datasets are not supported; load it without "
            "streaming=True, or collect the examples into a list for from_records."
        )
    if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"from_dataset: expected a datasets.Dataset, a DatasetDict or a path; got {type(source).__name__}."
        )
    path = pathlib.Path(source)
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    if not path.is_file():
        raise FileNotFoundError(f"from_dataset: no file or directory at {str(path)!r}.")
    if path.suffix == ".parquet":
        import pyarrow.parquet

        return datasets.Dataset(pyarrow.parquet.read_table(path))
    if path.suffix == ".arrow":
        return datasets.Dataset.from_file(str(path))
    raise ValueError(
        f"from_dataset: {str(path)!r} is not a .parquet or .arrow file or a save_to_disk directory "
        f"(for JSON lines use from_jsonl)."
    )


def from_dataset(
    dataset: Any,
    *,
    tokenizer: transformers.PreTrainedTokenizerBase,
    reward_fns: RewardFn | Sequence[RewardFn],
    prompt: str = "prompt",
    test_dataset: Any = None,
    test_fraction: float = 0.0,
    split_seed: int = 0,
    **settings: Any,
) -> TextTask:
    """A :class:`TextTask` over a local Hugging Face dataset (needs ``datasets``:
    ``pip install 'jaxrl_llm[datasets]'``).

    Args:
      dataset: a ``datasets.Dataset``; a ``DatasetDict`` (its ``"train"`` split, and its
        ``"test"`` split when it has one); or a path to a ``.parquet`` or ``.arrow`` file
        or a ``save_to_disk`` directory. Examples are read one at a time when drawn.
      test_dataset: the test split, in the same forms (a ``DatasetDict``: its ``"test"``).
        Without it, ``test_fraction`` (:func:`from_records`), or empty.
      tokenizer, reward_fns, prompt, **settings: see :func:`from_records`.
    """
    datasets = _import_datasets()
    train = load_dataset_source(dataset)
    test = None if test_dataset is None else load_dataset_source(test_dataset)
    if isinstance(train, datasets.DatasetDict):
        if "train" not in train:
            raise ValueError(
                f"from_dataset: the DatasetDict has no 'train' split; its splits are "
                f"{_listing(train)}. Pass the split to train on, e.g. dataset['{next(iter(train), '')}']."
            )
        if "test" in train:
            if test is not None:
                raise ValueError(
                    "from_dataset: the DatasetDict has a 'test' split and `test_dataset` was given too; "
                    "pass one of them."
                )
            test = train["test"]
        train = train["train"]
    if isinstance(test, datasets.DatasetDict):
        if "test" not in test:
            raise ValueError(f"from_dataset: `test_dataset` has no 'test' split; its splits are {_listing(test)}.")
        test = test["test"]
    return from_records(
        train,
        tokenizer=tokenizer,
        reward_fns=reward_fns,
        prompt=prompt,
        test_records=test,
        test_fraction=test_fraction,
        split_seed=split_seed,
        **settings,
    )


__all__ = [
    "PLAIN_TEMPLATE",
    "RESERVED_COLUMNS",
    "TextTask",
    "from_dataset",
    "from_jsonl",
    "from_records",
    "load_dataset_source",
    "read_jsonl",
]
