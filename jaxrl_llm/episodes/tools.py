"""Checking tools and calling them.

A tool is TRL's: a plain function (sync or ``async``) or a bound method, with a type hint
on every argument and a Google-style docstring whose ``Args:`` section describes each one,
so that ``transformers.utils.get_json_schema`` renders its schema into the prompt. The
model calls it by ``__name__`` with keyword arguments; what it returns becomes the tool
message's content (``str(result)``, or a list of content blocks as it is).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from transformers.utils import get_json_schema

from jaxrl_llm.episodes.parsing import MalformedCall, ToolCall


def check_tools(tools: Iterable[Callable], *, where: str) -> tuple[Callable, ...]:
    """``tools`` as a tuple, after checking each is a callable with a unique ``__name__``
    and a JSON schema transformers can render. ``where`` names them in errors
    (``"tools"``, ``"environment 'game'"``).

    Raises:
      TypeError: ``tools`` is not a list of callables.
      ValueError: a tool has no name, two share one, or a tool has no schema (a missing
        type hint, or no Google-style docstring describing each argument under ``Args:``).
    """
    if callable(tools) or isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
        raise TypeError(f"{where}: expected a list of tool functions; got {type(tools).__name__}.")
    tools = tuple(tools)
    seen = set()
    for index, tool in enumerate(tools):
        if not callable(tool):
            raise TypeError(f"{where}: tool {index} is not callable; got {tool!r:.80}.")
        name = getattr(tool, "__name__", None)
        if not isinstance(name, str):
            raise ValueError(
                f"{where}: tool {index} ({tool!r:.80}) has no __name__; a tool must be a function or a method, "
                f"which the model calls by name."
            )
        if name in seen:
            raise ValueError(
                f"{where}: two tools are named {name!r}; the model calls tools by name, so names must differ."
            )
        seen.add(name)
        try:
            get_json_schema(tool)
        except Exception as error:
            raise ValueError(
                f"{where}: tool {name!r} has no JSON schema transformers can render ({error}). A tool needs a type "
                f"hint on every argument and a Google-style docstring with an `Args:` section that describes each "
                f"argument (https://huggingface.co/docs/transformers/en/chat_extras#passing-tools)."
            ) from error
    return tools


class ToolResult(NamedTuple):
    """One call's outcome, the content of its ``{"role": "tool", "name": name, "content": content}`` message."""

    name: str  # the tool called ("unknown" for a malformed call that shows none)
    content: str | list  # str(result), a list of content blocks as returned, or str({"error": ...})
    failed: bool  # the call raised, timed out, was malformed or named no tool
    timed_out: bool  # abandoned at the timeout


def call_tools(
    calls: Sequence[tuple[Mapping[str, Callable], ToolCall | MalformedCall]],
    *,
    timeout: float | None,
) -> list[ToolResult]:
    """Runs each call with the tools of its episode; results in the order of ``calls``.

    Args:
      calls: ``(toolbox, call)`` pairs: the tools by name available to the call's episode,
        and the call (:func:`~jaxrl_llm.episodes.parsing.parse_turn`).
      timeout: seconds, from when this function is called, after which a call still
        running is abandoned; ``None`` waits for every call.

    Calls run concurrently: each sync tool in a daemon thread, except that the calls to
    methods of one object (an environment) run one after another in their order here, in
    one thread, as the model wrote them; async tools run on one event loop, in a daemon
    thread this module starts once. As TRL: a result becomes ``str(result)`` (a list is
    kept), and a tool that raises (arguments that do not fit its signature included),
    a name not in the toolbox (``"Tool {name} not found."``) or a malformed call becomes
    ``str({"error": message})`` with ``failed``. A call past the timeout gets such an error
    too, with ``timed_out``: an async one is cancelled, but a sync thread cannot be killed,
    so a hung sync tool is left running as a daemon thread (its later calls in the same
    object's sequence are not started), and may still change its object's state.

    Raises:
      ValueError: ``timeout`` is not ``None`` or a finite number > 0.
      TypeError: a call is not a ToolCall or MalformedCall.
    """
    if timeout is not None and (
        not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not 0 < timeout < math.inf
    ):
        raise ValueError(f"call_tools: `timeout` must be a finite number of seconds > 0, or None; got {timeout!r}.")
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[ToolResult | None] = [None] * len(calls)
    sequences: dict[Any, list[tuple[int, Callable, dict]]] = {}  # one thread each
    coroutines: dict[int, concurrent.futures.Future] = {}
    names = []
    for index, (toolbox, call) in enumerate(calls):
        if isinstance(call, MalformedCall):
            names.append(call.name)
            results[index] = _error(call.name, f"The tool call could not be parsed: {call.reason}.")
            continue
        if not isinstance(call, ToolCall):
            raise TypeError(f"call_tools: call {index} must be a ToolCall or MalformedCall; got {type(call).__name__}.")
        names.append(call.name)
        tool = toolbox.get(call.name)
        if tool is None:
            results[index] = _error(call.name, f"Tool {call.name} not found.")
        elif inspect.iscoroutinefunction(tool):
            coroutines[index] = asyncio.run_coroutine_threadsafe(
                _awaited(tool, call.arguments, deadline), _event_loop()
            )
        else:
            owner = tool.__self__ if inspect.ismethod(tool) else None
            key = ("object", id(owner)) if owner is not None else ("call", index)
            sequences.setdefault(key, []).append((index, tool, call.arguments))
    workers = [_Worker(jobs) for jobs in sequences.values()]
    for worker in workers:
        worker.thread.start()

    def remaining() -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    outcomes: dict[int, tuple[bool, Any]] = {}  # index -> (returned, value or exception)
    concurrent.futures.wait(list(coroutines.values()), timeout=remaining())
    for index, future in coroutines.items():
        if not future.done():
            future.cancel()  # cancels the task on the loop
        elif not future.cancelled():
            error = future.exception()
            outcomes[index] = (True, future.result()) if error is None else (False, error)
    for worker in workers:
        worker.thread.join(remaining())
        worker.abandoned.set()  # a thread past the deadline starts no more calls
        outcomes.update(dict(worker.outcomes))
    for index, name in enumerate(names):
        if results[index] is not None:
            continue
        if index not in outcomes or isinstance(outcomes[index][1], _TimedOut):
            results[index] = _error(name, f"Tool {name} timed out after {timeout:g} s.", timed_out=True)
        elif outcomes[index][0]:
            value = outcomes[index][1]
            results[index] = ToolResult(name, value if isinstance(value, list) else str(value), False, False)
        else:
            error = outcomes[index][1]
            results[index] = _error(name, str(error) or type(error).__name__)
    return results


def _error(name: str, message: str, *, timed_out: bool = False) -> ToolResult:
    return ToolResult(name, str({"error": message}), True, timed_out)


class _TimedOut(Exception):
    """An async call cancelled at the deadline (not a TimeoutError the tool raised itself)."""


class _Worker:
    """A daemon thread that runs ``jobs`` (index, tool, arguments) one after another."""

    def __init__(self, jobs: list[tuple[int, Callable, dict]]):
        self.jobs = jobs
        self.outcomes: dict[int, tuple[bool, Any]] = {}
        self.abandoned = threading.Event()
        self.thread = threading.Thread(target=self._run, name="jaxrl_llm-tool", daemon=True)

    def _run(self) -> None:
        for index, tool, arguments in self.jobs:
            if self.abandoned.is_set():
                return
            try:
                self.outcomes[index] = (True, tool(**arguments))
            except BaseException as error:  # a tool's SystemExit too: the thread reports, not dies
                self.outcomes[index] = (False, error)


async def _awaited(tool: Callable, arguments: dict, deadline: float | None) -> Any:
    if deadline is None:
        return await tool(**arguments)
    scope = asyncio.timeout(max(deadline - time.monotonic(), 0.0))
    try:
        async with scope:
            return await tool(**arguments)
    except TimeoutError:
        if scope.expired():
            raise _TimedOut from None
        raise


_loop_lock = threading.Lock()
_loop: tuple[asyncio.AbstractEventLoop, threading.Thread, int] | None = None  # loop, its thread, process id


def _event_loop() -> asyncio.AbstractEventLoop:
    """The module's event loop, running in a daemon thread: started on first use (again
    after a fork, whose child has no such thread), then reused."""
    global _loop
    with _loop_lock:
        if _loop is None or not _loop[1].is_alive() or _loop[2] != os.getpid():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="jaxrl_llm-tools-loop", daemon=True)
            thread.start()
            _loop = (loop, thread, os.getpid())
        return _loop[0]


def _gather(awaitables: Sequence[Awaitable]) -> list:
    """Runs ``awaitables`` concurrently on the module's event loop; their results, in order
    (the first exception raised is raised here)."""

    async def gather() -> list:
        return list(await asyncio.gather(*awaitables))

    return asyncio.run_coroutine_threadsafe(gather(), _event_loop()).result()
