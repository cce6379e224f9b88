"""TRL's ``environment_factory``: stateful objects whose public methods are the model's tools.

An environment is what the factory returns: an object with

- ``reset(**example) -> str | list | None`` (required): starts an episode from the
  example's columns; a returned observation is appended to the prompt's last message.
  Instances are reused across batches ("construct once, reset often"), so ``reset``
  must clear everything the previous episode left behind.
- public methods (names not starting with ``_``): its tools, with the same
  requirements as standalone tools (:func:`~jaxrl_llm.episodes.tools.check_tools`).
- ``get_reward() -> float`` (optional, sync or async): the episode's reward from the
  environment's state, a reward function logged under the class name
  (:meth:`Environments.reward_functions`).

``environment_factory`` is one factory, or a dict name -> factory, in which case each
example's ``environment`` column names the one it uses (and is not passed to ``reset``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jaxrl_llm.episodes.tools import check_tools, run_concurrently

_RESERVED = ("reset", "get_reward")
"""The environment's methods that are not tools."""


def _methods(instance: Any) -> list[Callable]:
    """``instance``'s tools: its bound public methods other than ``reset`` and ``get_reward``."""
    return [
        method
        for name, method in inspect.getmembers(instance, inspect.ismethod)
        if name not in _RESERVED and not name.startswith("_")
    ]


class Environments:
    """The environments of a run: a pool of instances per factory, and their tools.

    Args:
      factory: a callable returning an environment, or a dict name -> such callable
        (then each example's ``environment`` column picks one).
      tools: standalone tools, offered beside every environment's methods.

    At construction one instance per factory is built (it seeds the pool) to check it
    has a callable ``reset`` and that its methods, with ``tools``, are valid tools with
    distinct names. Not thread-safe: one batch of episodes at a time.

    Attributes:
      multi: ``factory`` is a dict (examples pick by their ``environment`` column).
      factories: name -> factory (the one factory under ``None``).
      tools: the standalone tools, checked.
    """

    def __init__(self, factory: Callable[[], Any] | Mapping[str, Callable[[], Any]], *, tools: Iterable[Callable] = ()):
        self.multi = isinstance(factory, Mapping)
        if self.multi:
            if not factory or not all(isinstance(name, str) for name in factory):
                raise ValueError(
                    f"environment_factory as a dict must map environment names (str) to factories; got keys "
                    f"{list(factory)!r}."
                )
            factories = dict(factory)
        else:
            factories = {None: factory}
        for name, fn in factories.items():
            if not callable(fn):
                raise TypeError(
                    f"{_label(name)} must be a callable that returns an environment (a class, or a function); "
                    f"got {fn!r:.80}."
                )
        self.factories: dict[str | None, Callable[[], Any]] = factories
        self.tools = check_tools(tools, where="tools")
        self._tools: dict[str | None, tuple[Callable, ...]] = {}
        self._pool: dict[str | None, list[Any]] = {}
        for name in factories:
            instance = self._build(name)
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(
                    f"{_label(name)} returned a {type(instance).__name__}, which has no callable `reset`; an "
                    f"environment needs `reset(**example) -> str | None`, called at the start of each episode."
                )
            where = "the tools and " + ("the environment" if name is None else f"environment {name!r}")
            self._tools[name] = check_tools(self.tools + tuple(_methods(instance)), where=where)
            self._pool[name] = [instance]

    def _build(self, name: str | None) -> Any:
        try:
            return self.factories[name]()
        except Exception as error:
            error.add_note(f"(while {_label(name)} built an environment)")
            raise

    def names(self, columns: Mapping[str, Sequence[Any]], count: int) -> list[str | None]:
        """Each of ``count`` examples' environment name: its ``environment`` column with a
        dict of factories, ``None`` with one factory.

        Raises:
          ValueError: with a dict, no ``environment`` column, one of another length, or a
            name that is not one of the dict's.
        """
        if not self.multi:
            return [None] * count
        column = columns.get("environment")
        if column is None:
            raise ValueError(
                f"environment_factory is a dict of environments {list(self.factories)}: each example needs an "
                f"`environment` column naming its environment; the data has columns {sorted(columns)}."
            )
        if len(column) != count:
            raise ValueError(f"The `environment` column has {len(column)} values for {count} examples.")
        names = list(column)
        self._check(names)
        return names

    def _check(self, names: Iterable[str | None]) -> None:
        if unknown := [name for name in dict.fromkeys(names) if name not in self.factories]:
            valid = list(self.factories) if self.multi else [None]
            raise ValueError(
                f"Unknown environment {unknown[0]!r} (in the `environment` column); environment_factory has {valid}."
            )

    def tools_for(self, name: str | None) -> tuple[Callable, ...]:
        """The tools an episode of environment ``name`` sees: the standalone tools, then the
        environment's methods (bound to the probe instance: for the prompt's schema)."""
        self._check([name])
        return self._tools[name]

    def toolbox(self, instance: Any) -> dict[str, Callable]:
        """The tools by name an episode in ``instance`` calls: the standalone tools and
        ``instance``'s methods (for :func:`~jaxrl_llm.episodes.tools.call_tools`)."""
        return {tool.__name__: tool for tool in (*self.tools, *_methods(instance))}

    def acquire(self, names: Sequence[str | None]) -> list[Any]:
        """One instance per episode, for environments ``names``: the ``k``-th episode of an
        environment gets its pool's ``k``-th instance, built when the pool has fewer. The
        same instances come back on the next call, to be reset for new episodes."""
        self._check(names)
        handed: dict[str | None, int] = {}
        instances = []
        for name in names:
            pool, index = self._pool[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(self._build(name))
            handed[name] = index + 1
            instances.append(pool[index])
        return instances

    def reset(self, instances: Sequence[Any], examples: Sequence[Mapping[str, Any]]) -> list[str | list | None]:
        """Starts each episode: ``instance.reset(**example)`` (every column, but ``environment``
        with a dict of factories); the observations returned, ``None`` for none.

        Raises:
          TypeError: a ``reset`` returned other than a str, a list of content blocks or None.
        """
        if len(instances) != len(examples):
            raise ValueError(f"reset: {len(instances)} environments for {len(examples)} examples.")
        observations = []
        for instance, example in zip(instances, examples):
            arguments = {key: value for key, value in example.items() if not (self.multi and key == "environment")}
            observation = instance.reset(**arguments)
            if observation is not None and not isinstance(observation, (str, list)):
                raise TypeError(
                    f"{type(instance).__name__}.reset returned {type(observation).__name__}; it must return the "
                    f"observation to append to the prompt (a str, or a list of content blocks) or None."
                )
            observations.append(observation)
        return observations

    def reward_functions(self) -> list[Callable]:
        """A reward function per environment class that defines ``get_reward``, named after it.

        Each is ``fn(prompts, completions, environments, **kwargs) -> list[float | None]``
        in TRL's convention: ``get_reward()`` of each environment of exactly that class
        (async ones awaited, together), ``None`` for the others.
        """
        classes = []
        for pool in self._pool.values():
            cls = type(pool[0])
            if callable(getattr(pool[0], "get_reward", None)) and cls not in classes:
                classes.append(cls)
        return [_reward_function(cls) for cls in classes]


def _label(name: str | None) -> str:
    return "environment_factory" if name is None else f"environment_factory[{name!r}]"


def _reward_function(cls: type) -> Callable:
    def reward(prompts, completions, environments, **kwargs) -> list[float | None]:
        values: list[Any] = [None] * len(environments)
        pending = {}  # index -> awaitable
        for index, environment in enumerate(environments):
            if type(environment) is cls:
                value = environment.get_reward()
                if inspect.isawaitable(value):
                    pending[index] = value
                else:
                    values[index] = value
        if pending:
            for index, value in zip(pending, run_concurrently(list(pending.values()))):
                values[index] = value
        return values

    reward.__name__ = reward.__qualname__ = cls.__name__
    reward.__doc__ = f"``{cls.__name__}.get_reward()`` of each episode in a {cls.__name__}; None for the others."
    return reward


def append_observation(prompt: Sequence[Mapping[str, Any]], observation: str | list | None) -> list[dict]:
    """A new prompt with ``observation`` appended to the last message's content (TRL's rule:
    a str to a str concatenates; otherwise both become lists of content blocks, a str as
    ``{"type": "text", "text": ...}``). An empty prompt becomes one user message.
    ``prompt`` and its messages are left as they are."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"append_observation: the prompt must be a list of chat messages; got {type(prompt).__name__}. "
            f"Environments need conversational prompts ([{{'role': 'user', 'content': ...}}])."
        )
    if observation is None:
        return [dict(message) for message in prompt]
    if not prompt:
        return [{"role": "user", "content": observation}]
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [dict(message) for message in prompt[:-1]] + [{**prompt[-1], "content": content + observation}]
