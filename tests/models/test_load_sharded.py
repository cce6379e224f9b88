"""``models.from_pretrained(..., mesh=)``: each tensor read straight into its shards."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl_llm import models, sharding
from jaxrl_llm.models import hf as hf_io
from tests.models.hf_fixtures import tiny_hf_model

MESHES = [(1, 8, 1), (1, 4, 2), (2, 2, 2)]  # data x fsdp x tensor


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """qwen2 (q/k/v biases, separate LM head) and qwen3 (q/k norms, tied embeddings)."""
    paths = {}
    for family, tied in (("qwen2", False), ("qwen3", True)):
        paths[family] = tmp_path_factory.mktemp(family)
        tiny_hf_model(family, tie_word_embeddings=tied).save_pretrained(paths[family])
    return paths


def _flat(tree) -> dict:
    return {
        path: leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf for path, leaf in nnx.to_flat_state(tree)
    }


@pytest.fixture
def callbacks(monkeypatch):
    """Every ``make_array_from_callback`` of the load: ``(shape, sharding, [shapes handed to devices])``."""
    calls = []
    original = jax.make_array_from_callback

    def spy(shape, placement, callback, dtype=None):
        handed = []

        def recorded(index):
            data = callback(index)
            handed.append(np.shape(data))
            return data

        calls.append((tuple(shape), placement, handed))
        return original(shape, placement, recorded, dtype=dtype)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    return calls


def _assert_placed(params, mesh, rules):
    """Each leaf carries the rules' sharding, and each device holds its shard alone: ``1/k``
    of every dimension split over a ``k``-device axis."""
    expected = _flat(sharding.param_shardings(params, mesh, rules))
    split = 0
    for path, leaf in _flat(params).items():
        assert leaf.sharding == expected[path], (path, leaf.sharding, expected[path])
        spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        want = tuple(n // mesh.shape[axis] if axis else n for n, axis in zip(leaf.shape, spec))
        assert want == leaf.sharding.shard_shape(leaf.shape)
        assert len(leaf.addressable_shards) == mesh.size
        for shard in leaf.addressable_shards:
            assert shard.data.shape == want, (path, shard.device, shard.data.shape, want)
        split += any(spec)
    return split


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_load_on_a_mesh_is_the_plain_load_placed_by_the_rules(checkpoints, callbacks, family, mesh_shape):
    data, fsdp, tensor = mesh_shape
    mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    model, plain = models.from_pretrained(checkpoints[family])
    assert not callbacks  # the plain load reads whole tensors, as before
    sharded_model, params = models.from_pretrained(checkpoints[family], mesh=mesh)
    assert sharded_model.config == model.config
    chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(plain))
    chex.assert_trees_all_equal_shapes_and_dtypes(params, plain)
    split = _assert_placed(params, mesh, sharding.RULES["fsdp_tensor"])  # the default rules
    assert split >= 7 * model.config.num_layers  # every matrix of every layer, biases and embeddings
    q_proj = _flat(params)[("layers", 0, "self_attn", "q_proj")]
    assert tuple(q_proj.sharding.spec) == ("fsdp",) + (("tensor",) if tensor > 1 else ())
    # No device was handed more than its shard: the host sliced each tensor per device.
    assert len(callbacks) == len(_flat(params))
    for shape, placement, handed in callbacks:
        assert handed and all(h == placement.shard_shape(shape) for h in handed), (shape, placement, handed)


def test_bfloat16_and_custom_rules_split_head_dim_too(checkpoints, callbacks):
    """Rules that split ``head_dim`` (never a preset) slice inside each head; a float32 file
    rounded to bfloat16 shard by shard equals the plain bfloat16 load."""
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=4)
    rules = (("head_dim", sharding.TENSOR), ("embed", sharding.FSDP))
    _, plain = models.from_pretrained(checkpoints["qwen2"], jnp.bfloat16)
    _, params = models.from_pretrained(checkpoints["qwen2"], jnp.bfloat16, mesh=mesh, rules=rules)
    chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(plain))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    _assert_placed(params, mesh, rules)
    flat = _flat(params)
    assert flat[("layers", 0, "self_attn", "q_proj")].sharding.spec == PartitionSpec("fsdp", None, "tensor")
    assert flat[("layers", 0, "self_attn", "o_proj")].sharding.spec == PartitionSpec(None, "tensor", "fsdp")
    assert flat[("layers", 0, "self_attn", "k_bias")].sharding.spec == PartitionSpec(None, "tensor")


def test_an_indexed_multi_file_checkpoint_loads_onto_a_mesh(tmp_path):
    model, params = models.init(
        models.ModelConfig(
            vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
        ),
        jax.random.key(3),
    )
    models.save_pretrained(tmp_path, model, params, max_shard_bytes=4096)
    assert len(set(json.loads((tmp_path / hf_io.INDEX_FILE).read_text())["weight_map"].values())) > 1
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    _, loaded = models.from_pretrained(tmp_path, mesh=mesh, rules=sharding.RULES["fsdp"])
    chex.assert_trees_all_equal(jax.device_get(loaded), jax.device_get(params))
    _assert_placed(loaded, mesh, sharding.RULES["fsdp"])


def test_a_mesh_load_raises_what_the_plain_load_raises(tmp_path):
    model, params = models.init(
        models.ModelConfig(
            vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8
        ),
        jax.random.key(4),
    )
    models.save_pretrained(tmp_path, model, params)
    file = tmp_path / hf_io.WEIGHTS_FILE
    tensors = safetensors.numpy.load_file(file)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((31, 16), np.float32)
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
    mesh = sharding.make_mesh(fsdp=8)
    message = r"'model.layers.0.mlp.up_proj.weight' has shape \[31, 16\] in the checkpoint, but the config implies"
    for kwargs in ({}, {"mesh": mesh}):
        with pytest.raises(ValueError, match=message):
            models.from_pretrained(tmp_path, **kwargs)
    with pytest.raises(ValueError, match="pass `mesh=` too"):
        models.from_pretrained(tmp_path, rules=sharding.RULES["fsdp"])
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        models.from_pretrained(tmp_path, mesh=mesh, rules=(("embed", "model"),))
