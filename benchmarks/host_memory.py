r"""Host memory that a long run keeps: where it comes from, shown without this library.

A run's resident memory grows a little with every checkpoint it saves (``docs/runs.md``,
"Host memory over long runs"). This measures the growth per call of each suspect, each in
a fresh process so that one does not hide another, with the resident set size read from
``/proc/self/statm`` after a warm-up and a ``gc.collect()``:

* ``tensorstore KvStore.Spec(...).to_json()``: what orbax does for every array it saves
  (``orbax.checkpoint._src.serialization.tensorstore_utils``);
* ``tensorstore experimental_collect_matching_metrics``: what orbax's pytree handler does
  around every save;
* ``orbax StandardCheckpointer.save``: a 16-array pytree saved to a fresh step directory
  each call, orbax and tensorstore only;
* ``jaxrl_llm Checkpointer.save``: the library's checkpointer over the same pytree;
* ``a jitted update``: an Adam step of the same size, no saving (the control).

What a save keeps grows with the number of saves; what the control keeps levels off
after the allocator's first few megabytes (compare ``--calls 300`` and ``--calls 1200``).
``docs/runs.md`` has the figures.

    python benchmarks/host_memory.py [--calls 400]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

CASES = {
    "tensorstore KvStore.Spec(...).to_json()": "spec_to_json",
    "tensorstore experimental_collect_matching_metrics": "collect_metrics",
    "orbax StandardCheckpointer.save (16 arrays)": "orbax_save",
    "jaxrl_llm Checkpointer.save (16 arrays)": "library_save",
    "a jitted Adam update, no saving (control)": "jitted_update",
}
WARM_UP = 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pytree():
    import jax.numpy as jnp

    return {f"w{i}": jnp.full((64, 64), float(i)) for i in range(16)}


def make_call(case: str, directory: str):
    """A function of the call's index that does one unit of ``case``."""
    if case == "spec_to_json":
        import tensorstore as ts

        return lambda i: ts.KvStore.Spec({"driver": "file", "path": f"{directory}/{i}/"}).to_json()
    if case == "collect_metrics":
        import tensorstore as ts

        return lambda i: json.dumps(ts.experimental_collect_matching_metrics("/tensorstore/"))
    if case == "orbax_save":
        import orbax.checkpoint as ocp

        checkpointer, tree = ocp.StandardCheckpointer(), pytree()

        def save(i):
            checkpointer.save(f"{directory}/{i}", tree)
            checkpointer.wait_until_finished()

        return save
    if case == "library_save":
        from jaxrl_llm import training

        checkpointer, tree = training.Checkpointer(directory, max_to_keep=2), pytree()

        return lambda i: checkpointer.save(i, tree)  # waits for the write (wait=True)
    if case == "jitted_update":
        import jax
        import optax

        optimizer, tree = optax.adam(1e-3), pytree()
        state = [tree, optimizer.init(tree)]

        @jax.jit
        def update(params, opt_state):
            updates, opt_state = optimizer.update(jax.tree.map(jax.numpy.ones_like, params), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def step(i):
            state[:] = update(*state)
            jax.block_until_ready(state)

        return step
    raise ValueError(f"unknown case {case!r}; the cases are {sorted(CASES.values())}")


def measure(case: str, calls: int) -> float:
    """Bytes of resident memory gained per call of ``case`` (after a warm-up), in this process."""
    with tempfile.TemporaryDirectory() as directory:
        call = make_call(case, directory)
        for i in range(WARM_UP):
            call(i)
        gc.collect()
        before = resident_bytes()
        for i in range(WARM_UP, WARM_UP + calls):
            call(i)
        gc.collect()
        return (resident_bytes() - before) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="calls measured per case, after the warm-up")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # run one case in this process
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(measure(args.case, args.calls)))
        return
    print(f"Resident memory gained per call, each case in a fresh process ({args.calls} calls after {WARM_UP}):")
    print(f"| {'case':<52} | {'KB per call':>11} |")
    print(f"|{'-' * 54}|{'-' * 13}|")
    for label, case in CASES.items():
        command = [sys.executable, __file__, "--case", case, "--calls", str(args.calls)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        per_call = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {label:<52} | {per_call / 1024:>11.1f} |", flush=True)


if __name__ == "__main__":
    main()
