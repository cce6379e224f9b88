"""``models.from_pretrained(..., mesh=)``: each tensor read straight into its shards, in
either layout of the layers (``scan_layers``: each ``[L, ...]`` leaf from its ``L``
per-layer tensors), and ``save_pretrained`` of either layout writes the same tensors."""

import dataclasses
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
from jaxrl_llm.models import decoder
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


def _tensors(directory) -> dict[str, np.ndarray]:
    """Every tensor of a saved checkpoint, one file or an index of several."""
    index = directory / hf_io.INDEX_FILE
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {hf_io.WEIGHTS_FILE}
    tensors = {}
    for name in files:
        tensors.update(safetensors.numpy.load_file(directory / name))
    return tensors


def _assert_same_tensors(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)  # bit for bit


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)], ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_stacked_load_is_the_stacked_plain_load_on_one_device_and_on_a_mesh(
    checkpoints, callbacks, family, mesh_shape
):
    model, plain = models.from_pretrained(checkpoints[family])
    stacked_model, stacked = models.from_pretrained(checkpoints[family], scan_layers=True)
    assert not callbacks
    assert stacked_model.config == dataclasses.replace(model.config, scan_layers=True)
    expected = decoder.stack_layers(plain)
    assert jax.tree.structure(stacked) == jax.tree.structure(expected)  # stacked paths and logical axes
    chex.assert_trees_all_equal(stacked, expected)

    data, fsdp, tensor = mesh_shape
    mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    _, params = models.from_pretrained(checkpoints[family], mesh=mesh, scan_layers=True)
    chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(expected))
    split = _assert_placed(params, mesh, sharding.RULES["fsdp_tensor"])
    assert split >= 7  # every stacked matrix, biases and embeddings
    q_proj = _flat(params)[("layers", "self_attn", "q_proj")]
    assert q_proj.shape[0] == model.config.num_layers
    assert tuple(q_proj.sharding.spec) == (None, "fsdp") + (("tensor",) if tensor > 1 else ())  # layers whole
    # One read per stacked leaf, and no device was handed more than its shard of it.
    assert len(callbacks) == len(_flat(params))
    for shape, placement, handed in callbacks:
        assert handed and all(h == placement.shard_shape(shape) for h in handed), (shape, placement, handed)


def test_saving_a_stacked_model_writes_the_tensors_of_the_unrolled_model(checkpoints, tmp_path):
    model, plain = models.from_pretrained(checkpoints["qwen2"])
    models.save_pretrained(tmp_path / "unrolled", model, plain)
    expected = _tensors(tmp_path / "unrolled")
    assert any(".layers.1." in name for name in expected)
    stacked_model, stacked = models.with_scan_layers(model, plain, True)
    models.save_pretrained(tmp_path / "stacked", stacked_model, stacked)
    _assert_same_tensors(_tensors(tmp_path / "stacked"), expected)
    config_file = tmp_path / "stacked" / "config.json"
    assert config_file.read_text() == (tmp_path / "unrolled" / "config.json").read_text()  # the layout is not in it
    # Placed on a mesh (read there stacked), and split over several files: the same tensors.
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    placed_model, placed = models.from_pretrained(checkpoints["qwen2"], mesh=mesh, scan_layers=True)
    assert not _flat(placed)[("layers", "mlp", "up_proj")].sharding.is_fully_replicated
    models.save_pretrained(tmp_path / "placed", placed_model, placed, max_shard_bytes=4096)
    assert (tmp_path / "placed" / hf_io.INDEX_FILE).exists()
    _assert_same_tensors(_tensors(tmp_path / "placed"), expected)
    # And what was saved stacked loads back, in either layout, as the params it came from.
    chex.assert_trees_all_equal(models.from_pretrained(tmp_path / "placed")[1], plain)
    chex.assert_trees_all_equal(models.from_pretrained(tmp_path / "stacked", scan_layers=True)[1], stacked)
