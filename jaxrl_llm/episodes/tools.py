"""Checking tools and calling them.

A tool is TRL's: a plain function (sync or ``async``) or a bound method, with a type hint
on every argument and a Google-style docstring whose ``Args:`` section describes each one,
so that ``transformers.utils.get_json_schema`` renders its schema into the prompt
(:func:`jaxrl_llm.tasks.base.tool_schema`, once per function). The
model calls it by ``__name__`` with keyword arguments; what it returns becomes the tool
message's content (``str(result)``, or a list of content blocks as it is).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import numbers
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jaxrl_llm.episodes.parsing import MalformedCall, ToolCall
from jaxrl_llm.tasks.base import tool_schema


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
            tool_schema(tool)
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
    timed_out: bool  # cut off at the timeout


def call_tools(
    calls: Sequence[tuple[Mapping[str, Callable], ToolCall | MalformedCall]],
    *,
    timeout: float | None,
) -> list[ToolResult]:
    """Runs each call with the tools of its episode; results in the order of ``calls``.

    Args:
      calls: ``(toolbox, call)`` pairs: the tools by name available to the call's episode,
        and the call (:func:`~jaxrl_llm.episodes.parsing.parse_turn`).
      timeout: seconds one call may take, its result's conversion to text included;
        ``None`` waits for every call.

    As TRL: sync tools (an environment's methods among them) run one after another in the
    calling thread, in the order of ``calls``, so that a tool may use ``signal`` as it does
    under TRL; async tools run concurrently meanwhile, on one event loop in a daemon thread
    this module starts once. A result becomes ``str(result)`` (a list is kept). A tool that
    raises an ``Exception`` or ``SystemExit`` (arguments that do not fit its signature
    included), a name not in the toolbox (``"Tool {name} not found."``) and a malformed call
    become ``str({"error": message})`` with ``failed``; a ``KeyboardInterrupt`` stops the
    caller. A call past the timeout gets an error too, with ``timed_out``:

    - a sync call in the main thread is interrupted by ``SIGALRM`` (``signal.setitimer``),
      the previous handler and timer restored after it. A tool that arms its own alarm
      (``signal.alarm``) replaces this one for the rest of its call, and its own timeout
      applies;
    - an async call is cancelled;
    - a sync call from another thread (where ``signal`` does not work) runs in a daemon
      thread that is abandoned at the timeout, and may still change its object's state.

    Raises:
      ValueError: ``timeout`` is not ``None`` or a finite number > 0.
      TypeError: a call is not a ToolCall or MalformedCall.
    """
    if timeout is not None and (
        not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not 0 < timeout < math.inf
    ):
        raise ValueError(f"call_tools: `timeout` must be a finite number of seconds > 0, or None; got {timeout!r}.")
    results: list[ToolResult | None] = [None] * len(calls)
    synchronous: list[tuple[int, Callable, dict]] = []
    coroutines: dict[int, concurrent.futures.Future] = {}
    for index, (toolbox, call) in enumerate(calls):
        if isinstance(call, MalformedCall):
            results[index] = _error(call.name, f"The tool call could not be parsed: {call.reason}.")
            continue
        if not isinstance(call, ToolCall):
            raise TypeError(f"call_tools: call {index} must be a ToolCall or MalformedCall; got {type(call).__name__}.")
        tool = toolbox.get(call.name)
        if tool is None:
            results[index] = _error(call.name, f"Tool {call.name} not found.")
        elif inspect.iscoroutinefunction(tool):
            coroutines[index] = asyncio.run_coroutine_threadsafe(_awaited(tool, call.arguments, timeout), _event_loop())
        else:
            synchronous.append((index, tool, call.arguments))
    submitted = time.monotonic()
    for index, tool, arguments in synchronous:
        name = calls[index][1].name
        results[index] = _result(name, functools.partial(_called, tool, arguments), timeout)
    waited = None if timeout is None else max(submitted + timeout - time.monotonic(), 0.0)
    concurrent.futures.wait(list(coroutines.values()), timeout=waited)
    for index, future in coroutines.items():
        name = calls[index][1].name
        if not future.done() or future.cancelled():
            future.cancel()  # cancels the task on the loop
            results[index] = _timed_out(name, timeout)
        elif isinstance(future.exception(), _TimedOut):
            results[index] = _timed_out(name, timeout)
        elif future.exception() is not None:
            results[index] = _error(name, _message(future.exception()))
        else:
            results[index] = _result(name, functools.partial(_content, future.result()), timeout)
    return results


def _content(value: Any) -> str | list:
    return value if isinstance(value, list) else str(value)


def _called(tool: Callable, arguments: dict) -> str | list:
    return _content(tool(**arguments))


def _result(name: str, produce: Callable[[], str | list], timeout: float | None) -> ToolResult:
    """``produce()``'s content as ``name``'s result, with at most ``timeout`` seconds to give it."""
    try:
        return ToolResult(name, _within(produce, timeout), False, False)
    except _TimedOut:
        return _timed_out(name, timeout)
    except (Exception, SystemExit) as error:  # a tool's sys.exit (argparse on bad arguments) too
        return _error(name, _message(error))


def _within(produce: Callable[[], Any], timeout: float | None) -> Any:
    """``produce()``, interrupted with :class:`_TimedOut` after ``timeout`` seconds."""
    if timeout is None:
        return produce()
    if threading.current_thread() is not threading.main_thread():
        return _in_daemon_thread(produce, timeout)
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:  # one raise at most, however late the alarm is handled
            armed[0] = False
            raise _TimedOut

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, timeout)
    started = time.monotonic()

    def disarm() -> None:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:  # an alarm the caller had armed goes on, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(previous_delay - (time.monotonic() - started), 1e-6))

    try:
        try:
            return produce()
        finally:
            disarm()
    except _TimedOut:
        disarm()  # again, in case the alarm interrupted the first
        raise


def _in_daemon_thread(produce: Callable[[], Any], timeout: float) -> Any:
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, produce()))
        except BaseException as error:  # reported to the caller, not printed by the thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="jaxrl_llm-tool", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise _TimedOut
    returned, value = outcome[0]
    if returned:
        return value
    raise value


def _message(error: BaseException) -> str:
    """``str(error)``, or the exception's type when that is empty or raises."""
    try:
        return str(error) or type(error).__name__
    except Exception:
        return type(error).__name__


def _error(name: str, message: str, *, timed_out: bool = False) -> ToolResult:
    return ToolResult(name, str({"error": message}), True, timed_out)


def _timed_out(name: str, timeout: float | None) -> ToolResult:
    return _error(name, f"Tool {name} timed out after {timeout:g} s.", timed_out=True)


class _TimedOut(BaseException):
    """A call cut off at the timeout (not a TimeoutError the tool raised itself). A
    ``BaseException``, so that a tool's own ``except Exception`` does not swallow it."""


async def _awaited(tool: Callable, arguments: dict, timeout: float | None) -> Any:
    if timeout is None:
        return await tool(**arguments)
    scope = asyncio.timeout(timeout)
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


def run_concurrently(awaitables: Sequence[Awaitable]) -> list:
    """Runs ``awaitables`` concurrently on the module's event loop; their results, in order
    (the first exception raised is raised here)."""

    async def gather() -> list:
        return list(await asyncio.gather(*awaitables))

    return asyncio.run_coroutine_threadsafe(gather(), _event_loop()).result()
