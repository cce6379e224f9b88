r"""Per-device memory of the whole train state on each mesh and sharding preset, against one device.

The train state of :func:`jaxrl_llm.training.init_state` and the fixed params of
:func:`jaxrl_llm.training.fixed_params` are what stays resident on the devices for a whole
run: the policy's params, AdamW's state (two float32 moments and, for bfloat16 params, a
float32 master copy of each: :func:`jaxrl_llm.training.optim.in_float32`), the reference
params and, for PPO, the critic (a copy of the backbone with a value head) and its
optimizer state. This prints, for a Qwen2.5-0.5B-shaped model (``qwen2``: 24
layers, hidden 896, 14 query / 2 KV heads of 64, MLP 4864, vocab 151936, tied
embeddings; 494M parameters), the bytes each device holds on the meshes
``data x fsdp x tensor`` = 8x1x1, 1x8x1, 2x4x1, 2x2x2, 1x4x2 with the presets of
:data:`jaxrl_llm.sharding.RULES`, and their ratio to one device.

Nothing is allocated: the state is ``jax.eval_shape(init_state, ...)`` of the abstract
params (:func:`jaxrl_llm.models.abstract`), each leaf's sharding comes from
:func:`jaxrl_llm.training.state_shardings` (the reference's from
:func:`jaxrl_llm.training.fixed_shardings`), and a device's bytes are the sum, over the
leaves it holds, of ``prod(sharding.shard_shape(shape)) * itemsize``; the table gives the
largest device's. (``tests/test_sharding_memory.py`` checks this count against a real
``jax.device_put`` of a small model's state on 8 CPU devices.) A preset is listed only on
meshes where it differs from the simpler one (``fsdp_tensor`` on a mesh without a
``tensor`` axis is ``fsdp``; every preset on 8x1x1 is ``data_parallel``).

The ideal share is ``1 / (fsdp x tensor)``; what stays above it is whole on every device:
the norm scales the rules never split, the critic's value head, the step counters and
PRNG key (and, on a ``tensor`` axis of 4, the 2 KV heads, which it could not split).

    python benchmarks/state_memory.py [--param-dtype bfloat16] [--algorithms grpo,ppo]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from jaxrl_llm import algorithms, models, sharding, training
from jaxrl_llm.runs import policy

QWEN2_5_0_5B = models.ModelConfig(
    architecture="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope=models.RopeConfig(theta=1e6),
    tie_word_embeddings=True,
    attention_bias=True,
)
"""Qwen2.5-0.5B's shapes (random weights: only shapes and dtypes are used)."""
MESHES = ((8, 1, 1), (1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2))  # data x fsdp x tensor
GROUPS = ("params", "optimizer", "reference", "critic", "other")
"""Columns: policy params, their optimizer state, reference params, critic params with
their optimizer state, and the rest (counters, PRNG key, running baseline)."""


def layouts(meshes: Iterable[tuple[int, int, int]] = MESHES) -> list[tuple[tuple[int, int, int], str]]:
    """``(mesh shape, preset)`` pairs where the preset differs from a simpler one on that mesh."""
    rows = []
    for shape in meshes:
        _, fsdp, tensor = shape
        presets = (
            ["data_parallel"]
            if fsdp == tensor == 1
            else (["fsdp"] if fsdp > 1 else []) + (["fsdp_tensor"] if tensor > 1 else [])
        )
        rows += [(shape, preset) for preset in presets]
    return rows


def resident(state: training.TrainState, fixed: training.FixedParams) -> dict:
    """What stays on the devices for a run, one tree: the state's fields and the reference,
    as a run's checkpoint holds them (:func:`jaxrl_llm.runs.policy.checkpointed`)."""
    return policy.checkpointed(state, fixed.reference)


def abstract_state(config: models.ModelConfig, algorithm: algorithms.Algorithm, run: training.TrainConfig):
    """``jax.eval_shape`` of what is resident at step 0 (:func:`resident`): ``ShapeDtypeStruct``
    leaves, nothing allocated."""
    model, params = models.abstract(config)
    state = jax.eval_shape(lambda p: training.init_state(model, p, algorithm, run), params)
    return model, resident(state, jax.eval_shape(lambda p: training.fixed_params(p, algorithm, run), params))


def _group(field: str) -> str:
    return {
        "params": "params",
        "opt_state": "optimizer",
        policy.REFERENCE: "reference",
        "critic_params": "critic",
        "critic_opt_state": "critic",
    }.get(field, "other")


def bytes_per_device(state: dict, shardings: dict) -> dict[jax.Device, dict[str, int]]:
    """Each device's bytes of ``state`` (:func:`resident`'s tree, arrays or abstract) placed by
    ``shardings`` (a tree of ``Sharding``s of the same structure), by column of
    :data:`GROUPS`: per leaf, ``prod(shard_shape(shape)) * itemsize`` on every device of its
    sharding."""
    totals: dict[jax.Device, dict[str, int]] = {}
    for field in state:
        leaves = jax.tree.leaves(state[field])
        placements = jax.tree.leaves(shardings[field])
        assert len(leaves) == len(placements), field
        for leaf, placement in zip(leaves, placements):
            size = math.prod(placement.shard_shape(leaf.shape)) * leaf.dtype.itemsize  # a PRNG key: its 8 bytes
            for device in placement.device_set:
                per_device = totals.setdefault(device, dict.fromkeys(GROUPS, 0))
                per_device[_group(field)] += size
    return totals


def largest(totals: dict[jax.Device, dict[str, int]]) -> dict[str, int]:
    """The columns of the device holding the most bytes, and their ``total``."""
    device = max(totals, key=lambda d: sum(totals[d].values()))
    return {**totals[device], "total": sum(totals[device].values())}


def table(
    config: models.ModelConfig,
    algorithm: algorithms.Algorithm,
    run: training.TrainConfig,
    meshes: Iterable[tuple[int, int, int]] = MESHES,
) -> list[tuple[str, str, dict[str, int]]]:
    """``(mesh, preset, largest device's bytes)`` rows: one device first, then each layout.
    The meshes are built over the CPU devices (only their count matters: nothing is placed)."""
    _, state = abstract_state(config, algorithm, run)
    devices = jax.devices("cpu")
    one = jax.sharding.SingleDeviceSharding(devices[0])
    rows = [("1 device", "-", largest(bytes_per_device(state, jax.tree.map(lambda _: one, state))))]
    for shape, preset in layouts(meshes):
        data, fsdp, tensor = shape
        mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor, devices=devices)
        shardings = policy.checkpoint_shardings(state, algorithm, run, mesh, sharding.RULES[preset])
        rows.append(("x".join(map(str, shape)), preset, largest(bytes_per_device(state, shardings))))
    return rows


def main(argv=None) -> dict[str, list]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--param-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the params' dtype (bfloat16: AdamW keeps float32 master copies)",
    )
    parser.add_argument("--algorithms", default="grpo,ppo", help="comma-separated presets, e.g. grpo,ppo")
    parser.add_argument("--tiny", action="store_true", help="the default ModelConfig's small model (a smoke run)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)  # the meshes' 8 devices, as CPU devices (before JAX starts)
    if len(jax.devices("cpu")) < 8:
        parser.error(f"the meshes need 8 CPU devices; this process has {len(jax.devices('cpu'))}")
    dtype = jnp.dtype(args.param_dtype)
    config = dataclasses.replace(models.ModelConfig() if args.tiny else QWEN2_5_0_5B, param_dtype=dtype)
    run = training.TrainConfig()
    _, params = models.abstract(config)
    count = sum(math.prod(p.shape) for p in jax.tree.leaves(params))

    label = (
        "default ModelConfig"
        if args.tiny
        else "Qwen2.5-0.5B-shaped (qwen2, 24 layers, hidden 896, 14/2 heads of 64, MLP 4864, vocab 151936, tied)"
    )
    print(
        f"train state per device: {label}, {count / 1e6:.1f}M params in {args.param_dtype}, AdamW"
        f"{' with float32 master copies' if dtype != jnp.float32 else ''}; the largest device's bytes, from each "
        f"leaf's sharding.shard_shape (nothing allocated)"
    )
    results = {}
    for name in args.algorithms.split(","):
        algorithm = algorithms.get(name.strip())
        rows = table(config, algorithm, run)
        results[algorithm.name] = rows
        single = rows[0][2]["total"]
        unit, scale = ("GiB", 2.0**30) if single >= 2**30 else ("MiB", 2.0**20)
        print()
        print(f"{algorithm.name.upper()}" + (" (with its critic)" if algorithm.needs_critic else ""))
        print()
        print(
            f"| mesh (data x fsdp x tensor) | rules | params | optimizer | reference | critic + its optimizer | "
            f"other | total {unit} | of one device | ideal |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for mesh_name, preset, parts in rows:
            if mesh_name == "1 device":
                ideal = 1
            else:
                _, fsdp, tensor = map(int, mesh_name.split("x"))
                ideal = {"data_parallel": 1, "fsdp": fsdp, "fsdp_tensor": fsdp * tensor}[preset]
            print(
                f"| {mesh_name} | {preset} | "
                + " | ".join(f"{parts[g] / scale:.3f}" for g in GROUPS)
                + f" | {parts['total'] / scale:.3f} | {parts['total'] / single:.4f} | {1 / ideal:.4f} |"
            )
    return results


if __name__ == "__main__":
    main()
