"""A run with stacked layers (``model.scan_layers = true``): it trains, its checkpoints hold
the stacks, it continues exactly, and a continued run keeps the layout."""

import ast
import dataclasses
import json

import chex
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models, runs
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs.config import differences
from jaxrl_llm.runs.directory import CHECKPOINTS, RUN_MANAGEMENT
from tests.runs.test_resume import without_timings


def stacked(steps: int, *, lora_rank: int = 0) -> run_config.RunConfig:
    """The ``tiny`` run with stacked, rematerialised layers (and adapters of ``lora_rank``)."""
    config = run_config.load("tiny")
    model = dataclasses.replace(config.model, scan_layers=True, remat="full")
    return dataclasses.replace(config, model=model, lora=run_config.LoraSpec(rank=lora_rank), steps=steps)


def stored_paths(checkpoint_dir):
    """The array paths a checkpoint holds, from orbax's tree metadata."""
    metadata = json.loads((checkpoint_dir / "state" / "_METADATA").read_text())
    return ["/".join(ast.literal_eval(key)) for key in metadata["tree_metadata"]]


def test_a_continued_run_may_not_change_the_layers_layout():
    stored = stacked(4)
    changed = dataclasses.replace(stored, model=dataclasses.replace(stored.model, scan_layers=False))
    assert differences(stored, changed, ignore=RUN_MANAGEMENT) == ["model.scan_layers: True -> False"]
    remat = dataclasses.replace(stored, model=dataclasses.replace(stored.model, remat="none"))
    assert differences(stored, remat, ignore=RUN_MANAGEMENT) == []  # an execution option may change


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_stacked_run_checkpoints_the_stacks_and_continues_to_the_straight_runs_params(tmp_path, lora_rank):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    runs.train_run(stacked(4, lora_rank=lora_rank), straight, progress=False, stream=None)
    runs.train_run(stacked(2, lora_rank=lora_rank), halves, progress=False, stream=None)
    runs.train_run(stacked(4, lora_rank=lora_rank), halves, resume=True, progress=False, stream=None)
    assert without_timings(runs.read_metrics(halves)) == without_timings(runs.read_metrics(straight))

    # The checkpoint holds one [L, ...] array per weight kind (per adapter with LoRA), no layer's own leaves.
    trained = "params/layers/"
    layer_paths = [p for p in stored_paths(straight / CHECKPOINTS / "4") if p.startswith(trained)]
    assert layer_paths and not any(p.split("/")[2].isdigit() for p in layer_paths)
    assert all(p.split("/")[-2].endswith(("_lora_a", "_lora_b")) for p in layer_paths) == (lora_rank > 0)

    config, _, model, params, step = runs.restore_policy(straight)
    *_, continued_params, continued_step = runs.restore_policy(halves)
    assert step == continued_step == 4 and model.config.scan_layers
    chex.assert_trees_all_equal(continued_params, params)  # bitwise
    flat = dict(nnx.to_flat_state(params))
    assert flat[("layers", "self_attn", "q_proj")].shape[0] == config.model.num_layers
    # The same function as the unrolled layout of the same params.
    unrolled, unrolled_params = models.with_scan_layers(model, params, False)
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % model.config.vocab_size
    np.testing.assert_allclose(
        models.forward(model, params, tokens), models.forward(unrolled, unrolled_params, tokens), rtol=0, atol=1e-5
    )
