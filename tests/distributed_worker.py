"""One process of the two-process run in ``tests/test_distributed.py``; also imported by
that test to run the same train steps in one process.

    python -m tests.distributed_worker --process-id 0 --num-processes 2 --port 12345 \\
        --devices 4 --out DIR --checkpoints DIR

Each process: :func:`jaxrl_llm.distributed.initialize`, then on each mesh of
:data:`MESHES` (over both processes' devices) two GRPO train steps on a fixed batch of
which it feeds only its own rows, a collective checkpoint save and restore, and checks of
the row helpers on meshes that order the processes' devices apart. It writes
``process_<i>.npz`` (its rows, their advantages and old log-probs, the metrics) and
process 0 ``params_<mesh>.npz`` (the gathered params) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from jaxrl_llm.sampling import SamplingConfig

P, G, S, N = 8, 2, 4, 4  # prompts, group size, prompt tokens, completion tokens
B = P * G
STEPS = 2
MESHES = {  # name: (data, fsdp, tensor), sharding rules (the CLI's two-process test runs a 2 x 4 x 1 FSDP mesh)
    "tensor": ((2, 2, 2), "fsdp_tensor"),
}


def model_config():
    from jaxrl_llm import models

    return models.ModelConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        max_position_embeddings=S + N,
    )


def train_config():
    from jaxrl_llm import training

    # Two minibatches: score recomputes the old log-probs and update shuffles with the state's key.
    return training.TrainConfig(
        num_prompts=P,
        group_size=G,
        minibatch_size=B // 2,
        sampling=SamplingConfig(max_new_tokens=N),
        optimizer=training.OptimizerConfig(learning_rate=1e-2, warmup_steps=1),
    )


def synthetic_batch(vocab_size: int):
    """A fixed scored rollout as NumPy (the same in every process) and the
    ``PartitionSpec`` of each field: ``P`` left-padded prompts, carried once and split
    over ``data``; their ``G`` completions each (1 to ``N`` tokens) and rewards in [0, 1],
    split over ``data`` x ``fsdp``. The one place that knows the step's batch fields."""
    from jax.sharding import PartitionSpec

    from jaxrl_llm import training

    rng = np.random.default_rng(0)
    prompt_mask = np.arange(S)[None, :] >= rng.integers(0, 2, (P, 1))  # [P, S]: 0 or 1 pad on the left
    completion_mask = np.arange(N)[None, :] < rng.integers(1, N + 1, (B, 1))  # [B, N]
    batch = training.Batch(
        prompt_tokens=np.where(prompt_mask, rng.integers(1, vocab_size, (P, S)), 0).astype(np.int32),  # [P, S]
        prompt_mask=prompt_mask,
        completion_tokens=np.where(completion_mask, rng.integers(1, vocab_size, (B, N)), 0).astype(np.int32),
        completion_mask=completion_mask,
        sampling_logp=np.where(completion_mask, -rng.uniform(0.5, 3.0, (B, N)), 0.0).astype(np.float32),  # [B, N]
        rewards=rng.uniform(0.0, 1.0, B).astype(np.float32),  # [B]
        prompts_drawn=np.int32(P),
    )
    prompts, rows = PartitionSpec("data"), PartitionSpec(("data", "fsdp"))
    specs = training.Batch(
        prompt_tokens=prompts,
        prompt_mask=prompts,
        completion_tokens=rows,
        completion_mask=rows,
        sampling_logp=rows,
        rewards=rows,
        prompts_drawn=PartitionSpec(),
    )
    return batch, specs


def run_steps(mesh_shape, rules_name: str):
    """``STEPS`` GRPO train steps on the fixed batch, over a mesh of ``data x fsdp x
    tensor`` of ``jax.devices()`` (every process's), each process feeding its rows.

    Returns ``(state, rows, local, metrics)``: the final state, this process's rows, its
    rows' ``advantages`` and ``old_logp`` of the first step, every step's metrics."""
    import jax
    from jax.sharding import PartitionSpec

    from jaxrl_llm import algorithms, distributed, models, sharding, training

    mesh = sharding.make_mesh(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2])
    config = train_config()
    model, params = models.init(model_config(), jax.random.key(0))
    state = training.init_state(model, params, algorithms.GRPO, config)
    shardings = training.state_shardings(state, algorithms.GRPO, config, mesh, sharding.RULES[rules_name])
    state = distributed.put(state, shardings)
    fixed = training.fixed_params(params, algorithms.GRPO, config)
    fixed = distributed.put(fixed, training.fixed_shardings(fixed, mesh, sharding.RULES[rules_name]))
    train_step = training.make_train_step(model, algorithms.GRPO, config)
    jitted_score = jax.jit(train_step.score)
    jitted_update = jax.jit(train_step.update, out_shardings=(shardings, None), donate_argnums=0)
    score = lambda state, batch: jitted_score(state, fixed, batch)  # noqa: E731
    update = lambda state, scored: jitted_update(state, fixed, scored)  # noqa: E731

    batch, specs = synthetic_batch(model.config.vocab_size)
    mine = jax.tree.map(
        lambda leaf, spec: (
            leaf if spec == PartitionSpec() else leaf[distributed.local_rows(mesh, leaf.shape[0], spec=spec)]
        ),
        batch,
        specs,
    )  # this process's prompts and rows
    placed = distributed.global_array(mine, mesh, specs)
    rows = distributed.local_rows(mesh, B)
    local, history = {}, []
    for step in range(STEPS):
        scored, score_metrics = score(state, placed)
        if step == 0:
            local = distributed.to_local({"advantages": scored.advantages, "old_logp": scored.old_logp})
        state, update_metrics = update(state, scored)
        history.append(distributed.replicated_to_host({**score_metrics, **update_metrics}))
    return state, rows, local, history


def flat_params(params) -> dict[str, np.ndarray]:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def check_rows_on_interleaved_meshes() -> None:
    """The row helpers on meshes whose device order is not process-major: process ``i``
    holding rows ``{2i, 2i+1, 2i+4, 2i+5}`` of 8, and both holding every row (a ``tensor``
    axis across the processes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, Mesh, PartitionSpec

    from jaxrl_llm import distributed

    devices = np.array(jax.devices()).reshape(2, 2, 2)  # [process, pair, device]
    full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    me = jax.process_index()
    # data order: p0 d0 d1, p1 d0 d1, p0 d2 d3, p1 d2 d3 -> process i holds rows 2i, 2i+1, 2i+4, 2i+5.
    interleaved = Mesh(devices.transpose(1, 0, 2).reshape(8), ("data",), axis_types=(AxisType.Auto,))
    rows = distributed.local_rows(interleaved, 8)
    assert rows.tolist() == [2 * me, 2 * me + 1, 2 * me + 4, 2 * me + 5], rows
    x = distributed.global_array(full[rows], interleaved)
    np.testing.assert_array_equal(distributed.to_local(x), full[rows])
    doubled = jax.jit(lambda a: a * jnp.arange(8.0)[:, None])(x)  # rows meet their global index
    np.testing.assert_array_equal(distributed.gather(doubled), full * np.arange(8.0)[:, None])
    # fsdp over one process's devices, tensor across processes: every process holds every row.
    across = Mesh(devices.reshape(2, 4).T, ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    rows = distributed.local_rows(across, 8)
    assert rows.tolist() == list(range(8)), rows
    x = distributed.global_array(full, across)
    assert x.sharding.spec == PartitionSpec(("fsdp",))
    np.testing.assert_array_equal(distributed.to_local(x), full)
    total = jax.jit(jnp.sum)(x)
    assert float(distributed.replicated_to_host(total)) == full.sum()
    # Host values combined over processes.
    sums = distributed.process_sum({"rows": np.float32(len(rows)), "me": np.arange(3) + me})
    np.testing.assert_array_equal(sums["me"], 2 * np.arange(3) + 1)
    assert distributed.process_mean({"x": np.float32(me)})["x"] == 0.5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--devices", type=int, default=4, help="CPU devices of this process")
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoints", required=True)
    args = parser.parse_args(argv)

    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxrl_llm import distributed, training

    address = f"localhost:{args.port}"
    index, count = distributed.initialize(
        coordinator_address=address, num_processes=args.num_processes, process_id=args.process_id, timeout_s=60
    )
    assert (index, count) == (args.process_id, args.num_processes)
    assert distributed.initialize(
        coordinator_address=address, num_processes=args.num_processes, process_id=args.process_id
    ) == (index, count)  # a second call: the same
    try:
        distributed.initialize(coordinator_address=address, num_processes=args.num_processes + 1)
        raise AssertionError("initialize accepted other settings")
    except RuntimeError as error:
        assert "already connected" in str(error), error
    assert jax.device_count() == args.devices * count and jax.local_device_count() == args.devices
    assert distributed.is_main_process() == (index == 0)

    check_rows_on_interleaved_meshes()

    saved = {}
    for name, (mesh_shape, rules_name) in MESHES.items():
        state, rows, local, history = run_steps(mesh_shape, rules_name)
        saved[f"{name}/rows"] = rows
        saved.update({f"{name}/{key}": value for key, value in local.items()})
        saved.update(
            {
                f"{name}/metric/{step}/{key}": value
                for step, metrics in enumerate(history)
                for key, value in metrics.items()
            }
        )
        params = distributed.gather(state.params)
        if distributed.is_main_process():
            np.savez(os.path.join(args.out, f"params_{name}.npz"), **flat_params(params))

        # A collective save of the sharded state, and its restore onto the same shardings.
        with training.Checkpointer(os.path.join(args.checkpoints, name)) as checkpoints:
            checkpoints.save(STEPS, state, metadata={"mesh": name})
        with training.Checkpointer(os.path.join(args.checkpoints, name)) as checkpoints:
            assert checkpoints.all_steps() == [STEPS]
            restored = checkpoints.restore(like=state)
        assert jax.tree.structure(restored) == jax.tree.structure(state)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
            if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
                got, want = jax.random.key_data(got), jax.random.key_data(want)
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
            np.testing.assert_array_equal(distributed.to_local(got), distributed.to_local(want))
        saved[f"{name}/restored"] = np.bool_(True)

    np.savez(os.path.join(args.out, f"process_{index}.npz"), **saved)
    print(f"process {index} of {count}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
