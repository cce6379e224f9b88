"""The persistent compilation cache: a second process loads what the first compiled; the
user's own JAX setting and ``JAXRL_LLM_COMPILATION_CACHE=off`` are respected."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jaxrl_llm import compilation_cache

# Compiles one program and reports what the cache did, as JSON on the last line.
CHILD = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp
    from jaxrl_llm import compilation_cache

    events = []
    jax.monitoring.register_event_listener(lambda event, **_: events.append(event))
    if os.environ.get("COMPILE_FIRST"):  # JAX has compiled before the cache is enabled
        jax.jit(lambda x: x + 1)(jnp.zeros(3)).block_until_ready()
    if len(sys.argv) > 1:  # the user's own setting
        jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    directory = compilation_cache.enable()
    jax.jit(lambda x: jnp.cumsum(jnp.sin(x) @ x.T, axis=0))(jnp.ones((4, 4))).block_until_ready()
    print(json.dumps(dict(
        directory=directory, config=jax.config.jax_compilation_cache_dir,
        hits=events.count("/jax/compilation_cache/cache_hits"),
        entries=sorted(os.listdir(directory)) if directory else [])))
""")


def _start(cache: str, *args: str, compile_first: bool = False) -> subprocess.Popen:
    """CHILD in this environment without JAX's cache settings, with ``JAXRL_LLM_COMPILATION_CACHE=cache``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    env.update({compilation_cache.ENV: cache, "JAX_PLATFORMS": "cpu", "COMPILE_FIRST": "1" if compile_first else ""})
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    cache, user_cache = str(tmp_path / "cache"), str(tmp_path / "users")
    first = _start(cache, compile_first=True)
    off, users = _start("OFF"), _start(str(tmp_path / "ignored"), user_cache)
    first = _result(first)  # enabled after a first compilation, the cache still takes what follows
    assert first["directory"] == first["config"] == cache
    assert first["hits"] == 0 and any(name.endswith("-cache") for name in first["entries"])

    second = _result(_start(cache, compile_first=True))
    assert second["directory"] == cache and second["hits"] >= 1
    assert second["entries"] == first["entries"]  # loaded, nothing new to write

    off = _result(off)  # JAXRL_LLM_COMPILATION_CACHE=off: no cache at all
    assert off == dict(directory=None, config=None, hits=0, entries=[])

    users = _result(users)  # a directory set for JAX is kept, and so are JAX's other settings
    assert users["directory"] == users["config"] == user_cache
    assert not (tmp_path / "ignored").exists()


def test_the_default_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_directory() == str(tmp_path / "jaxrl_llm" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compilation_cache.default_directory() == os.path.expanduser("~/.cache/jaxrl_llm/jax")
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "mine"))
    assert compilation_cache.default_directory() == str(tmp_path / "mine")
    for off in ("off", "0", "False", "NONE"):
        monkeypatch.setenv(compilation_cache.ENV, off)
        assert compilation_cache.default_directory() is None


@pytest.mark.skipif(
    bool(os.environ.get("JAX_COMPILATION_CACHE_DIR")), reason="this process has a cache directory of its own"
)
def test_enable_is_idempotent_and_disable_undoes_it(monkeypatch, tmp_path):
    suites = jax.config.jax_compilation_cache_dir  # the test session's cache (conftest): set aside, then back
    compilation_cache.disable()
    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        assert compilation_cache.enable(tmp_path / "a") == str(tmp_path / "a")
        assert compilation_cache.enable(tmp_path / "a") == str(tmp_path / "a")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a") and (tmp_path / "a").is_dir()
        assert compilation_cache.enable(tmp_path / "b") == str(tmp_path / "b")  # ours to move
    finally:
        compilation_cache.disable()
    try:
        assert jax.config.jax_compilation_cache_dir is None
        assert jax.config.jax_persistent_cache_min_compile_time_secs == threshold
    finally:
        if suites:
            compilation_cache.enable(suites)


# models.init's draws, each a small program: kept off, then on as train turns it on.
INIT_CHILD = textwrap.dedent("""
    import dataclasses, json, os
    import jax
    from jaxrl_llm import models

    config = models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                                num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=16)
    models.init(config, jax.random.key(0), compilation_cache=False)
    off = jax.config.jax_compilation_cache_dir
    models.init(dataclasses.replace(config, hidden_size=24), jax.random.key(1))  # new shapes: compiled again
    directory = jax.config.jax_compilation_cache_dir
    print(json.dumps(dict(off=off, directory=directory, entries=sorted(os.listdir(directory)))))
""")


def test_models_init_turns_the_cache_on_unless_told_not_to(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    env.update({compilation_cache.ENV: str(tmp_path), "JAX_PLATFORMS": "cpu"})
    child = subprocess.run([sys.executable, "-c", INIT_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["off"] is None and result["directory"] == str(tmp_path)
    # The second init's draws were written; the first one's were compiled with no cache.
    assert any(name.startswith("jit__normal") for name in result["entries"])
