"""code_execution: extraction, TRL's calling convention, and a batch of hostile completions."""

import functools
import os
import socket

import pytest

from jaxrl_llm.rewards.code import code_execution, extract_code
from tests.rewards.test_sandbox import FORGE, running

GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
BAD = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"


# ------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, code",
    [
        ("```python\nx = 1\n```", "x = 1\n"),
        ("```\nx = 1\n```", "x = 1\n"),
        ("```py\nx = 1\n```", "x = 1\n"),
        ("no fences at all\nx = 1", "no fences at all\nx = 1"),
        ("```python\nx = 1\n```\nthen\n```python\nx = 2\n```\ndone", "x = 2\n"),
        # a later untagged block (example output) does not displace the Python block
        ("```python\nx = 1\n```\nOutput:\n```\n1\n```", "x = 1\n"),
        ("```bash\npip install x\n```\nand\n```\nx = 3\n```", "x = 3\n"),
        ("```text\nonly other languages\n```", "only other languages\n"),
        ("```python\nx = 1```", "x = 1"),  # closing fence on the code's last line
        ("```python\ndef f():\n    return 1", "def f():\n    return 1"),  # cut off: runs to the end
        ("1. Solution:\n   ```python\n   x = 1\n   y = 2\n   ```", "x = 1\ny = 2\n"),  # indented: dedented
        ("use ```inline``` code\n```python\nx = 5\n```", "x = 5\n"),
        ("```Python3 title\nx = 6\n```", "x = 6\n"),
    ],
)
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_extract_code_rejects_non_text():
    with pytest.raises(TypeError, match="text must be str"):
        extract_code(None)


# ------------------------------------------------------------------- convention


def test_rewards_pass_fail_and_not_applicable():
    rewards = code_execution(completions=[GOOD, BAD, GOOD, "def add(a, b) return"], tests=[TESTS, TESTS, None, TESTS])
    assert rewards == [1.0, 0.0, None, 0.0]
    assert all(type(r) is float for r in rewards if r is not None)


def test_trl_call_extra_columns_and_conversational_completions():
    conversational = [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": BAD}]]
    reward_fn = functools.partial(code_execution, timeout=5.0, max_workers=2)
    rewards = reward_fn(
        prompts=["p0", "p1"],
        completions=conversational,
        completion_ids=[[1], [2]],
        tests=[TESTS, TESTS],
        trainer_state=None,
    )
    assert rewards == [1.0, 0.0]


def test_exiting_before_the_tests_scores_zero():
    hack = "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n```"
    os_hack = "```python\nimport os\nos._exit(0)\n```"
    assert code_execution(completions=[hack, os_hack], tests=[TESTS, TESTS]) == [0.0, 0.0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="same length, got 2 and 1"):
        code_execution(completions=[GOOD, GOOD], tests=[TESTS])
    with pytest.raises(TypeError, match=r"tests\[0\] must be a str"):
        code_execution(completions=[GOOD], tests=[1])
    with pytest.raises(TypeError, match="must be a str or a list of chat messages"):
        code_execution(completions=[42], tests=[TESTS])
    with pytest.raises(ValueError, match="timeout must be finite and > 0"):
        code_execution(completions=[GOOD], tests=[TESTS], timeout=0)
    with pytest.raises(ValueError, match="memory_mb must be >= 64"):
        code_execution(completions=[GOOD], tests=[TESTS], memory_mb=1)
    with pytest.raises(TypeError, match="positional"):
        code_execution([GOOD], [TESTS])
    assert code_execution(completions=[], tests=[]) == []


# -------------------------------------------------------------------- containment


def _fence(code: str) -> str:
    return f"Sure!\n```python\n{code}\n```"


def test_hostile_batch_scores_zero_and_the_rest_still_pass(tmp_path, monkeypatch):
    """Each hostile completion's tests pass only if its attack worked; all must score 0.0
    and leave no trace, while the honest completions in the same batch score 1.0."""
    secret = "jaxrl-code-secret-93b1"
    monkeypatch.setenv("JAXRL_CODE_SECRET", secret)
    tmp_path.chmod(0o777)
    target = tmp_path / "pwned"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    marker = f"jaxrl-code-daemon-{os.getpid()}"

    honest = (GOOD, TESTS)
    hostile = {
        "infinite loop": (_fence("while True:\n    pass"), TESTS),
        "fork bomb": (_fence("import os\nwhile True:\n    os.fork()"), TESTS),
        "memory bomb": (_fence("hog = bytearray(8 * 1024**3)\ndef add(a, b):\n    return a + b"), TESTS),
        "network": (
            _fence(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')"),
            "connected = True\nassert connected",
        ),
        "write outside": (
            _fence(f"open({str(target)!r}, 'w').write('x')"),
            f"assert open({str(target)!r}).read() == 'x'",
        ),
        "read the environment": (_fence("import os\nenv = str(dict(os.environ))"), f"assert {secret!r} in env"),
        "output flood": (_fence("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"), TESTS),
        "daemon": (
            _fence(
                "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
                "    os._exit(0)\nos.wait()\ndef add(a, b):\n    return a + b"
            ),
            TESTS,
        ),
    }
    batch = [honest, *hostile.values(), honest]
    rewards = code_execution(
        completions=[c for c, _ in batch], tests=[t for _, t in batch], timeout=2.0, memory_mb=256, max_workers=2
    )
    assert rewards[0] == rewards[-1] == 1.0
    assert dict(zip(hostile, rewards[1:-1])) == dict.fromkeys(hostile, 0.0)
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody connected
    server.close()
    assert not target.exists()
    assert running(marker) == []


def test_forged_completions_score_zero():
    """Completions that try to report success for tests they fail: from their top level,
    from the function the tests call, or by reading the tests to answer them."""
    hacks = {
        "top level": FORGE + "forge()\ndef add(a, b):\n    return 0",
        "the tested function": FORGE + "def add(a, b):\n    forge()",
        "replaced exit": "import sys\nsys.exit = lambda *a: None\ndef add(a, b):\n    return 0",
        "reading the tests": (
            "import gc, sys\nseen = open(__file__).read() + open('/proc/self/cmdline', 'rb').read().decode('latin-1')\n"
            "seen += ' '.join(o for o in gc.get_objects() if type(o) is str)\n"
            "def add(a, b):\n    return 3 if 'jaxrl-sentinel-' + '1,2' in seen else 0"
        ),
    }
    tests = "assert add(1, 2) == 3, 'jaxrl-sentinel-1,2'"
    rewards = code_execution(completions=[_fence(h) for h in hacks.values()], tests=[tests] * len(hacks), timeout=5.0)
    assert dict(zip(hacks, rewards)) == dict.fromkeys(hacks, 0.0)
