"""Checking tools and calling them: TRL's documented tools run unchanged."""

import asyncio
import signal
import threading
import time

import pytest
import transformers
from transformers.utils import get_json_schema

from jaxrl_llm.episodes.parsing import MalformedCall, ToolCall
from jaxrl_llm.episodes.tools import ToolResult, call_tools, check_tools
from jaxrl_llm.tasks.base import render_chat, tool_schema
from jaxrl_llm.tasks.calculator import CALCULATOR_ALPHABET
from jaxrl_llm.tasks.char_tokenizer import build_chat_tokenizer

# The tools of TRL's GRPO documentation ("Agent Training" / "Tools"), as written there.


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def take_screenshot() -> list:
    """
    Takes a screenshot of the current screen.

    Returns:
        The screenshot image with a description.
    """
    return [{"type": "image", "image": "pixels"}, {"type": "text", "text": "Here is the screenshot."}]


def divide(a: float, b: float) -> float:
    """
    Divides two numbers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


TOOLBOX = {fn.__name__: fn for fn in (multiply, async_add, take_screenshot, divide)}


class TestCheckTools:
    def test_trl_tools_pass(self):
        assert check_tools([multiply, async_add, take_screenshot], where="tools") == (
            multiply,
            async_add,
            take_screenshot,
        )

    def test_bound_methods_pass(self):
        class Counter:
            def increment(self, step: int) -> int:
                """
                Increment the internal counter.

                Args:
                    step: Value to add to the counter.
                """
                return step

        counter = Counter()
        assert check_tools([counter.increment], where="tools") == (counter.increment,)

    def test_not_callable(self):
        with pytest.raises(TypeError, match="tools: tool 1 is not callable"):
            check_tools([multiply, "divide"], where="tools")
        with pytest.raises(TypeError, match="list of tool functions"):
            check_tools(multiply, where="tools")

    def test_duplicate_name(self):
        def make():
            def multiply(a: int) -> int:
                """
                Another.

                Args:
                    a: A number.
                """
                return a

            return multiply

        with pytest.raises(ValueError, match="environment 'game': two tools are named 'multiply'"):
            check_tools([multiply, make()], where="environment 'game'")

    def test_missing_type_hint(self):
        def search(query):
            """
            Searches.

            Args:
                query: What to look for.
            """

        with pytest.raises(ValueError, match="tool 'search' .*missing a type hint.*Google-style docstring"):
            check_tools([search], where="tools")

    def test_missing_args_section(self):
        def search(query: str) -> str:
            """Searches the web."""

        with pytest.raises(ValueError, match="tool 'search' .*no description for the argument 'query'.*Args:"):
            check_tools([search], where="tools")

    def test_no_name(self):
        class Tool:
            def __call__(self, a: int) -> int:
                return a

        with pytest.raises(ValueError, match="has no __name__"):
            check_tools([Tool()], where="tools")

    def test_a_callable_object_is_refused_as_transformers_would_refuse_to_render_it(self):
        class Tool:
            __name__ = "tool"

            def __call__(self, a: int) -> int:
                """
                Returns a.

                Args:
                    a: A number.
                """
                return a

        with pytest.raises(ValueError, match="tool 'tool' has no JSON schema.*a function, a bound method or a JSON"):
            check_tools([Tool()], where="tools")


class TestToolSchema:
    def test_the_schema_is_transformers_and_is_computed_once_per_function(self, monkeypatch):
        class Thermostat:
            def set_to(self, degrees: float) -> str:
                """
                Sets the target temperature.

                Args:
                    degrees: The temperature in Celsius.
                """
                return f"set to {degrees}"

        def square(x: float) -> float:
            """
            Squares a number.

            Args:
                x: The number.
            """
            return x * x

        calls = []
        monkeypatch.setattr(
            transformers.utils, "get_json_schema", lambda tool: calls.append(tool) or get_json_schema(tool)
        )
        first, second = Thermostat(), Thermostat()
        schemas = [tool_schema(tool) for tool in (square, first.set_to, square, second.set_to)]
        assert schemas == [get_json_schema(square), get_json_schema(first.set_to)] * 2
        assert list(schemas[1]["function"]["parameters"]["properties"]) == ["degrees"]  # no `self`
        assert calls == [square, first.set_to]  # the second instance's method shares its class's schema
        given = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
        assert tool_schema(given) is given
        with pytest.raises(TypeError, match="a function, a bound method or a JSON schema dict; got str"):
            tool_schema("multiply")

    def test_a_conversation_renders_as_transformers_renders_it_with_the_functions(self):
        tokenizer = build_chat_tokenizer(CALCULATOR_ALPHABET)
        messages = [{"role": "user", "content": "What is 2 + 3"}]
        for _ in range(2):  # the second from the schemas computed by the first
            ids = render_chat(tokenizer, messages, [multiply, divide], generation_prompt=True)
            expected = tokenizer.apply_chat_template(
                messages, tools=[multiply, divide], add_generation_prompt=True, return_dict=False
            )
            assert ids == list(expected) and "divide(a,b)" in tokenizer.decode(ids)


def run(*calls, timeout=5.0, toolbox=TOOLBOX):
    return call_tools([(toolbox, call) for call in calls], timeout=timeout)


class TestCallTools:
    def test_results_in_order(self):
        results = run(
            ToolCall("multiply", {"a": 3, "b": 4}),
            ToolCall("async_add", {"a": 1, "b": 2}),
            ToolCall("multiply", {"a": 5, "b": 6}),
        )
        assert results == [
            ToolResult("multiply", "12", False, False),
            ToolResult("async_add", "3", False, False),
            ToolResult("multiply", "30", False, False),
        ]

    def test_list_result_kept(self):
        (result,) = run(ToolCall("take_screenshot", {}))
        assert result.content == take_screenshot() and not result.failed

    def test_tool_that_raises(self):
        (result,) = run(ToolCall("divide", {"a": 1, "b": 0}))
        assert result == ToolResult("divide", "{'error': 'division by zero'}", True, False)

    def test_a_tool_that_exits_is_a_failed_call_and_ctrl_c_is_not_swallowed(self):
        def exits(code: int) -> int:
            """Exits, as argparse does on bad arguments.

            Args:
                code: The exit status.
            """
            raise SystemExit(code)

        def interrupted(x: int) -> int:
            """Ctrl-C arrives while it runs.

            Args:
                x: Anything.
            """
            raise KeyboardInterrupt

        (result,) = run(ToolCall("exits", {"code": 2}), toolbox={"exits": exits})
        assert result == ToolResult("exits", "{'error': '2'}", True, False)
        with pytest.raises(KeyboardInterrupt):
            run(ToolCall("interrupted", {"x": 1}), toolbox={"interrupted": interrupted})

    def test_unknown_tool(self):
        (result,) = run(ToolCall("search", {"query": "x"}))
        assert result == ToolResult("search", "{'error': 'Tool search not found.'}", True, False)

    def test_malformed_call(self):
        bad = MalformedCall('<tool_call>{"name": "multiply", "arguments": {</tool_call>', "the call is not valid JSON")
        (named, unnamed) = run(bad, MalformedCall("<tool_call>{", "the call is not valid JSON"))
        assert named.name == "multiply" and unnamed.name == "unknown"
        assert named.failed and not named.timed_out and "not valid JSON" in named.content

    def test_wrong_arguments(self):
        sync, asynchronous = run(ToolCall("multiply", {"a": 3, "c": 4}), ToolCall("async_add", {"a": 1}))
        assert sync.failed and "unexpected keyword argument 'c'" in sync.content
        assert asynchronous.failed and "missing 1 required positional argument: 'b'" in asynchronous.content

    def test_async_tool_that_raises(self):
        async def fail(x: int) -> int:
            raise RuntimeError(f"no {x}")

        (result,) = run(ToolCall("fail", {"x": 7}), toolbox={"fail": fail})
        assert result == ToolResult("fail", "{'error': 'no 7'}", True, False)

    def test_async_tool_raising_timeout_error_is_not_a_timeout(self):
        async def fetch(url: str) -> str:
            raise TimeoutError("the server did not answer")

        (result,) = run(ToolCall("fetch", {"url": "x"}), toolbox={"fetch": fetch})
        assert result.failed and not result.timed_out and "did not answer" in result.content

    def test_sync_tools_run_in_the_calling_thread_in_order(self):
        log = []

        def record(label: str) -> str:
            log.append((label, threading.current_thread() is threading.main_thread()))
            return label

        class Env:
            def act(self, label: str) -> str:
                return record(label)

        env = Env()
        calls = [
            ({"record": record}, ToolCall("record", {"label": "first"})),
            ({"act": env.act}, ToolCall("act", {"label": "second"})),
            ({"record": record}, ToolCall("record", {"label": "third"})),
        ]
        results = call_tools(calls, timeout=5)
        assert log == [("first", True), ("second", True), ("third", True)]
        assert [r.content for r in results] == ["first", "second", "third"]

    def test_async_tools_run_concurrently_with_the_sync_ones(self):
        started = threading.Event()

        async def signal_start(x: int) -> int:
            started.set()
            return x

        def wait_for_the_async_tool(x: int) -> int:
            if not started.wait(5):
                raise RuntimeError("the async tool did not start while the sync one ran")
            return x

        toolbox = {"signal_start": signal_start, "wait": wait_for_the_async_tool}
        results = run(ToolCall("wait", {"x": 1}), ToolCall("signal_start", {"x": 2}), toolbox=toolbox)
        assert results == [ToolResult("wait", "1", False, False), ToolResult("signal_start", "2", False, False)]

    def test_hung_sync_tool_times_out(self):
        release = threading.Event()

        def hang(x: int) -> int:
            release.wait(10)
            return x

        toolbox = {"hang": hang, "multiply": multiply}
        start = time.monotonic()
        try:
            hung, fine = run(
                ToolCall("hang", {"x": 1}), ToolCall("multiply", {"a": 2, "b": 3}), timeout=0.5, toolbox=toolbox
            )
        finally:
            release.set()
        assert 0.5 <= time.monotonic() - start < 1.5
        assert hung == ToolResult("hang", "{'error': 'Tool hang timed out after 0.5 s.'}", True, True)
        assert fine == ToolResult("multiply", "6", False, False)

    def test_hung_async_tool_is_cancelled(self):
        cancelled = threading.Event()

        async def wait_forever(x: int) -> int:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return x

        toolbox = {"wait_forever": wait_forever, "async_add": async_add}
        start = time.monotonic()
        hung, fine = run(
            ToolCall("wait_forever", {"x": 1}), ToolCall("async_add", {"a": 2, "b": 3}), timeout=0.5, toolbox=toolbox
        )
        assert 0.5 <= time.monotonic() - start < 1.5
        assert hung.failed and hung.timed_out and "timed out after 0.5 s" in hung.content
        assert fine == ToolResult("async_add", "5", False, False)
        assert cancelled.wait(2)

    def test_a_hung_method_is_interrupted_and_the_objects_next_call_runs(self):
        class Env:
            def __init__(self):
                self.calls = []

            def step(self, wait: bool) -> str:
                self.calls.append(wait)
                if wait:
                    threading.Event().wait(10)
                return "ok"

        env = Env()
        start = time.monotonic()
        results = run(
            ToolCall("step", {"wait": True}), ToolCall("step", {"wait": False}), timeout=0.3, toolbox={"step": env.step}
        )
        assert time.monotonic() - start < 1.5
        assert [(r.content, r.timed_out) for r in results] == [
            ("{'error': 'Tool step timed out after 0.3 s.'}", True),
            ("ok", False),
        ]
        assert env.calls == [True, False]

    def test_a_tool_that_catches_every_exception_is_still_cut_off(self):
        def stubborn(x: int) -> str:
            try:
                time.sleep(10)
            except Exception:
                return "caught"
            return "slept"

        (result,) = run(ToolCall("stubborn", {"x": 1}), timeout=0.3, toolbox={"stubborn": stubborn})
        assert result.timed_out

    def test_a_tool_with_its_own_signal_timeout(self):
        # The pattern of TRL's examples/scripts/grpo_agent.py: a SIGALRM context manager.
        class ToolTimeout(Exception):
            pass

        def query(seconds: float) -> str:
            def on_alarm(signum, frame):
                raise ToolTimeout("Operation timed out after 1 seconds")

            signal.signal(signal.SIGALRM, on_alarm)
            signal.alarm(1)
            try:
                time.sleep(seconds)
            finally:
                signal.alarm(0)
            return "rows"

        toolbox = {"query": query}
        fast, slow = run(ToolCall("query", {"seconds": 0.01}), ToolCall("query", {"seconds": 5}), toolbox=toolbox)
        assert fast == ToolResult("query", "rows", False, False)
        assert slow == ToolResult("query", "{'error': 'Operation timed out after 1 seconds'}", True, False)

    def test_the_callers_alarm_is_restored(self):
        fired = []
        previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.4)
            (result,) = run(ToolCall("multiply", {"a": 2, "b": 3}), timeout=5)
            assert result.content == "6"
            remaining, _ = signal.getitimer(signal.ITIMER_REAL)
            assert 0 < remaining <= 0.4
            time.sleep(0.6)
            assert fired == [signal.SIGALRM]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def test_the_results_text_is_made_within_the_timeout(self):
        class Slow:
            def __str__(self):
                time.sleep(10)
                return "late"

        class Broken:
            def __str__(self):
                raise RuntimeError("no text")

        def slow() -> str:
            """Returns something slow to print."""
            return Slow()

        def broken() -> str:
            """Returns something that cannot be printed."""
            return Broken()

        async def async_slow() -> str:
            """Returns something slow to print."""
            return Slow()

        toolbox = {"slow": slow, "broken": broken, "async_slow": async_slow}
        start = time.monotonic()
        late, failed, async_late = run(
            ToolCall("slow", {}), ToolCall("broken", {}), ToolCall("async_slow", {}), timeout=0.3, toolbox=toolbox
        )
        assert time.monotonic() - start < 2
        assert late.timed_out and async_late.timed_out
        assert failed == ToolResult("broken", "{'error': 'no text'}", True, False)

    def test_from_another_thread_a_hung_tool_is_abandoned(self):
        release = threading.Event()

        def hang(x: int) -> int:
            release.wait(10)
            return x

        outcome = []
        worker = threading.Thread(
            target=lambda: outcome.extend(run(ToolCall("hang", {"x": 1}), timeout=0.3, toolbox={"hang": hang}))
        )
        try:
            worker.start()
            worker.join(5)
        finally:
            release.set()
        assert [r.timed_out for r in outcome] == [True]

    def test_no_timeout_waits(self):
        async def nap(seconds: float) -> str:
            await asyncio.sleep(seconds)
            return "awake"

        (result,) = run(ToolCall("nap", {"seconds": 0.1}), timeout=None, toolbox={"nap": nap})
        assert result == ToolResult("nap", "awake", False, False)

    @pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), True, "5"])
    def test_bad_timeout(self, timeout):
        with pytest.raises(ValueError, match="`timeout` must be a finite number of seconds > 0, or None"):
            call_tools([], timeout=timeout)

    def test_not_a_call(self):
        with pytest.raises(TypeError, match="call 0 must be a ToolCall or MalformedCall"):
            call_tools([(TOOLBOX, {"name": "multiply"})], timeout=1)
