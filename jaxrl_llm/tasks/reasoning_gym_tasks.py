r"""Reasoning Gym's procedural datasets as tasks, scored by each dataset's own verifier.

`Reasoning Gym <https://github.com/open-thought/reasoning-gym>`_ (Stojanovski et al.,
2025) generates about a hundred families of verifiable problems (arithmetic, counting,
logic, puzzles, ...) offline, each with a ``score_answer(answer, entry)`` verifier.
Needs the ``reasoning-gym`` package: ``pip install 'jaxrl_llm[reasoning-gym]'``.

.. code-block:: python

    task = reasoning_gym("leg_counting", size=5000, seed=0, tokenizer=tokenizer)
    task.examples("train", np.arange(2), seed=0).prompts   # the questions

* **train** is ``create_dataset(name, size=size, seed=seed, **config)``, a finite split
  walked in epochs; **test** is the same generator with ``size=test_size`` and seed
  ``test_seed``, by default ``seed + size``. Reasoning Gym draws item ``i`` from
  ``Random(seed + i)``, so that default makes the test items the ones right after the
  train items: the splits never share a draw (a ``test_seed`` whose range overlaps the
  train range is refused). Small problem spaces can still repeat a problem.
* **prompt**: the ``question`` column, after :data:`DEFAULT_SYSTEM_PROMPT` (Reasoning
  Gym's own default), which asks for the final answer in ``<answer>...</answer>``.
* **reward** (:class:`ReasoningGymScore`): the dataset's
  ``score_answer(answer=extracted, entry=entry)``, where ``extracted`` is the content of
  the completion's last ``<answer>...</answer>`` (:func:`jaxrl_llm.rewards.extraction.answer_tag`)
  or ``None`` when there is none; the dataset decides what ``None`` scores (0.0 for most,
  0.01 for a few such as ``countdown``). Scores lie in [0, 1]; many datasets give partial
  credit.
* **columns**: the entry's keys (``answer``, the reference; ``metadata``) and ``entry``,
  the whole entry the verifier reads.
"""

from __future__ import annotations

import difflib
import importlib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import transformers

from jaxrl_llm.rewards.extraction import answer_tag, check_tag_name
from jaxrl_llm.tasks.base import RewardFn
from jaxrl_llm.tasks.text import TextTask, task_options

DEFAULT_SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and specific manner.\n"
    "Once you have thought about the reasoning process, provide the answer in the following format:\n"
    "<answer>answer here</answer>\n"
    "Do not explain your reasoning inside the answer tags, provide only the final answer. When an example is "
    "provided, you should strictly follow the format of the output/answer in that example.\n"
)
"""Reasoning Gym's ``SYSTEM_PROMPTS["default"]``, verbatim."""

_EXTRA = "pip install 'jaxrl_llm[reasoning-gym]'"


def _import_reasoning_gym():
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as error:
        raise ImportError(f"tasks.reasoning_gym needs the `reasoning-gym` package: {_EXTRA}.") from error


def dataset_names() -> list[str]:
    """The names of Reasoning Gym's registered datasets, sorted."""
    _import_reasoning_gym()
    return sorted(importlib.import_module("reasoning_gym.factory").DATASETS)


def create(name: str, *, size: int, seed: int, config: Mapping[str, Any] | None = None) -> Any:
    """``reasoning_gym.create_dataset(name, size=size, seed=seed, **config)``, with errors
    that list the dataset names, or the options of the dataset's config."""
    _import_reasoning_gym()
    factory = importlib.import_module("reasoning_gym.factory")
    if name not in factory.DATASETS:
        close = difflib.get_close_matches(str(name), factory.DATASETS, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"reasoning_gym: unknown dataset {name!r}.{hint} The datasets are: {', '.join(sorted(factory.DATASETS))}."
        )
    config = dict(config or {})
    if clash := [key for key in ("size", "seed") if key in config]:
        raise ValueError(f"reasoning_gym: pass {' and '.join(clash)} as arguments, not in `config`.")
    _, config_cls = factory.DATASETS[name]
    fields = sorted(getattr(config_cls, "__dataclass_fields__", {}))
    if unknown := [key for key in config if key not in fields]:
        options = ", ".join(f for f in fields if f not in ("size", "seed"))
        raise ValueError(
            f"reasoning_gym: {name!r} has no option(s) {', '.join(repr(k) for k in unknown)}; its "
            f"config ({config_cls.__name__}) has {options}."
        )
    try:
        return factory.create_dataset(name, size=size, seed=seed, **config)
    except AssertionError as error:  # Reasoning Gym validates its configs with assert
        raise ValueError(f"reasoning_gym: invalid config for {name!r} {config}: {error}") from None


class ReasoningGymScore:
    """A reward function (TRL's convention): the dataset's ``score_answer`` on the content
    of each completion's last ``<tag>...</tag>`` (``None`` when there is none), against the
    ``entry`` column. Logged as ``reasoning_gym``."""

    def __init__(self, dataset: Any, *, tag: str = "answer"):
        self.dataset = dataset
        self.tag = check_tag_name("ReasoningGymScore", "tag", tag)
        self.__name__ = "reasoning_gym"

    def __call__(self, *, completions: Sequence[str], entry: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[float]:
        if len(entry) != len(completions):
            raise ValueError(f"reasoning_gym: {len(entry)} entries for {len(completions)} completions.")
        return [
            float(self.dataset.score_answer(answer=answer_tag(text, tag=self.tag), entry=item))
            for text, item in zip(completions, entry, strict=True)
        ]

    def __repr__(self) -> str:
        return f"ReasoningGymScore({type(self.dataset).__name__}, tag={self.tag!r})"


class ReasoningGymSource:
    """The procedural source of :func:`reasoning_gym`: ``source(split, index, seed)`` is
    item ``index`` of that split's dataset (``seed`` is ignored: both splits are finite),
    with the entry itself under ``entry``. Generated items are kept, so later epochs do
    not generate them again."""

    def __init__(self, train: Any, test: Any):
        self.datasets = {"train": train, "test": test}
        self._cache: dict[tuple[str, int], dict[str, Any]] = {}

    def __call__(self, split: str, index: int, seed: int) -> dict[str, Any]:
        key = (split, index)
        if key not in self._cache:
            entry = self.datasets[split][index]
            self._cache[key] = {**entry, "entry": entry}
        return dict(self._cache[key])

    def __repr__(self) -> str:
        train = self.datasets["train"]
        return f"ReasoningGymSource({type(train).__name__}, train={len(train)}, test={len(self.datasets['test'])})"


def _count(name: str, value: Any, *, low: int) -> int:
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"reasoning_gym: `{name}` must be an int >= {low}; got {value!r}.")
    return int(value)


def reasoning_gym(
    name: str,
    *,
    tokenizer: transformers.PreTrainedTokenizerBase,
    size: int,
    seed: int = 0,
    test_size: int = 100,
    test_seed: int | None = None,
    config: Mapping[str, Any] | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    tag: str = "answer",
    reward_fns: RewardFn | Sequence[RewardFn] | None = None,
    **settings: Any,
) -> TextTask:
    """A Reasoning Gym dataset as a :class:`~jaxrl_llm.tasks.text.TextTask` (see the
    module docstring).

    Args:
      name: a registered dataset, e.g. ``"basic_arithmetic"``, ``"leg_counting"``
        (:func:`dataset_names`).
      tokenizer: see :class:`TextTask`.
      size, seed: the train split: ``size`` items from ``seed``.
      test_size, test_seed: the test split (``test_seed`` default ``seed + size``, so the
        splits never share an item's draw).
      config: the dataset's options, e.g. ``{"min_terms": 2, "max_terms": 3}`` for
        ``basic_arithmetic``.
      system_prompt: default :data:`DEFAULT_SYSTEM_PROMPT`; ``None`` for none (then the
        question alone does not ask for ``<answer>`` tags).
      tag: the tag the answer is read from.
      reward_fns: default ``(ReasoningGymScore(train_dataset, tag=tag),)``.
      **settings: other :class:`TextTask` options (``reward_weights``, ``chat_template``,
        ``chat_template_kwargs``, ``plain_template``, ``eos_ids``, ``pad_id``,
        ``checkpoint``, ``stop_strings``).
    """
    settings = task_options("reasoning_gym", settings)
    if "prompt" in settings:
        raise TypeError(
            "reasoning_gym: the prompt is the dataset's 'question' column; use `system_prompt` to instruct the model."
        )
    size = _count("size", size, low=1)
    test_size = _count("test_size", test_size, low=0)
    seed = _count("seed", seed, low=0)
    test_seed = seed + size if test_seed is None else _count("test_seed", test_seed, low=0)
    if test_size and test_seed < seed + size and seed < test_seed + test_size:
        raise ValueError(
            f"reasoning_gym: test_seed={test_seed} makes the test items (drawn from seeds "
            f"{test_seed}..{test_seed + test_size - 1}) share draws with the train items (seeds "
            f"{seed}..{seed + size - 1}); use test_seed >= {seed + size} (the default)"
            + (f" or <= {seed - test_size}." if seed >= test_size else ".")
        )
    train = create(name, size=size, seed=seed, config=config)
    test = create(name, size=max(test_size, 1), seed=test_seed, config=config)
    source = ReasoningGymSource(train, test)
    return TextTask(
        tokenizer=tokenizer,
        reward_fns=(ReasoningGymScore(train, tag=tag),) if reward_fns is None else reward_fns,
        example=source,
        sizes={"train": size, "test": test_size},
        prompt="question",
        system_prompt=system_prompt,
        **settings,
    )


__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ReasoningGymScore",
    "ReasoningGymSource",
    "create",
    "dataset_names",
    "reasoning_gym",
]
