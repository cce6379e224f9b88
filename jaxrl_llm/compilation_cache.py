"""JAX's persistent compilation cache, on by default for training runs.

A run compiles its sampler, ``score`` and ``update`` once per prompt width; for a real
model that is minutes. JAX can keep the compiled executables on disk, keyed by the
program, the devices, the compile options and the JAX/XLA versions, so that a restarted
or resumed run with the same shapes loads them instead of compiling again.
:func:`enable` turns that on; :func:`jaxrl_llm.models.init`, :func:`jaxrl_llm.training.train`
and ``jaxrl-llm`` call it unless told not to (their ``compilation_cache`` argument or setting):

* **Where.** The ``directory`` argument; else ``$JAXRL_LLM_COMPILATION_CACHE``; else
  ``$XDG_CACHE_HOME/jaxrl_llm/jax`` (``~/.cache/jaxrl_llm/jax``) (:func:`default_directory`).
* **Off.** ``JAXRL_LLM_COMPILATION_CACHE=off`` (or ``0``, ``false``, ``none``, in any
  case) leaves the cache off, unless ``enable`` is given a directory.
* **The user's settings win.** A directory already set for JAX (``jax.config.update(
  "jax_compilation_cache_dir", ...)``, ``set_cache_dir`` or ``JAX_COMPILATION_CACHE_DIR``)
  is kept and returned; ``jax_enable_compilation_cache=False`` keeps the cache off.
* **What is written.** Every program: JAX's minimum compile time for an entry, 1 s, is
  lowered to :data:`MIN_COMPILE_TIME_SECS` (0) when still at that default; its minimum
  entry size stays at none. The cache grows without bound (JAX's default) unless
  ``jax_compilation_cache_max_size`` caps it.

**When it takes effect** (checked in JAX 0.10): JAX opens the cache lazily, at the first
compilation that finds ``jax_compilation_cache_dir`` set, and then keeps that directory
for the process. Compilations before any directory is set use no cache and do not stop a
later one from being opened, so :func:`enable` may run after JAX has compiled something
(those earlier programs are simply not cached); to move an opened cache to another
directory JAX needs ``jax.experimental.compilation_cache.compilation_cache.reset_cache()``,
which :func:`enable` and :func:`disable` call whenever they change the directory.

**Trust.** JAX runs what it loads from the cache: anyone who can write to the directory
can run code in your process. The default lives under your home directory; do not point
it at a directory others can write to.
"""

from __future__ import annotations

import os
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

ENV = "JAXRL_LLM_COMPILATION_CACHE"
"""The environment variable that moves the cache (a path) or turns it off."""

OFF_VALUES = ("off", "0", "false", "none")
"""Values of :data:`ENV` (in any case) that turn the cache off."""

MIN_COMPILE_TIME_SECS = 0.0
"""Programs compiled in less time than this are not written. JAX hashes and looks up
every program whatever this threshold, so skipping small ones saves only disk: with it at
0, a second start of a small run on CPU took 3.5 s instead of 10.5 s (4.5 s at 0.1 s,
about 7 s at JAX's 1 s), for a cache of 60 files, 1 MB."""

_JAX_DEFAULT_MIN_COMPILE_TIME_SECS = 1.0

_ours: str | None = None  # the directory enable() set, which disable() may unset
_replaced_min_compile_time: float | None = None  # JAX's threshold before enable() lowered it


def default_directory() -> str | None:
    """``$JAXRL_LLM_COMPILATION_CACHE`` if it is a path, ``None`` if it turns the cache off
    (:data:`OFF_VALUES`), else ``$XDG_CACHE_HOME/jaxrl_llm/jax`` or ``~/.cache/jaxrl_llm/jax``."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, or not a valid XDG value
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrl_llm", "jax")


def enable(directory: str | os.PathLike | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache (see the module docstring).

    Args:
      directory: where to keep it (default: :func:`default_directory`).

    Returns:
      The directory in use: the user's own JAX setting if there is one, else the one set
      here; ``None`` when the cache stays off (:data:`ENV` says so, JAX's cache is
      disabled, or the directory cannot be created, which warns). Calling it again with
      the same directory changes nothing.
    """
    global _ours, _replaced_min_compile_time
    if not jax.config.jax_enable_compilation_cache:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current and current != _ours:
        return current  # the user's
    if not current and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        # Set after JAX was imported, so JAX has not read it: still the user's choice.
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        return jax.config.jax_compilation_cache_dir
    if directory is None:
        directory = default_directory()
        if directory is None:
            return None
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if directory == current:
        return directory
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        warnings.warn(
            f"compilation_cache.enable: cannot create {directory!r} ({error}); compiling without a persistent cache.",
            stacklevel=2,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    if _replaced_min_compile_time is None and (
        jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_TIME_SECS
    ):
        _replaced_min_compile_time = jax.config.jax_persistent_cache_min_compile_time_secs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    _jax_cache.reset_cache()  # JAX keeps the first directory it opened otherwise
    _ours = directory
    return directory


def disable() -> None:
    """Undoes :func:`enable`: JAX's cache directory and compile-time threshold go back to
    what they were. A directory the user set for JAX is left alone."""
    global _ours, _replaced_min_compile_time
    if _ours is not None and jax.config.jax_compilation_cache_dir == _ours:
        jax.config.update("jax_compilation_cache_dir", None)
        _jax_cache.reset_cache()
    if _replaced_min_compile_time is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", _replaced_min_compile_time)
    _ours = _replaced_min_compile_time = None
