"""LoRA runs (``[lora]``): settings, checkpoints of the adapters alone, the base stored once
or referenced by path and verified, exact continuation (SIGKILL included), eval and export."""

import ast
import dataclasses
import json
import signal
import subprocess

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import algorithms, cli, models, runs, training
from jaxrl_llm.models import lora
from jaxrl_llm.runs import build
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs.config import differences
from jaxrl_llm.runs.directory import (
    BASE_CHECKPOINT,
    BASE_FILE,
    CHECKPOINTS,
    CONFIG_FILE,
    RUN_MANAGEMENT,
    RunDirectoryError,
)
from jaxrl_llm.runs.policy import load_base
from tests.models.test_lora import KERNELS, perturbed
from tests.runs.test_resume import (
    command,
    complete_checkpoints,
    environment,
    stop_after_a_checkpoint,
    without_timings,
)

RANK = 4


DIGITS_REWARD = """
def digits(completions, **kwargs):
    return [sum(c.isdigit() for c in completion) / max(len(completion), 1) for completion in completions]
"""
"""A reward that varies within a group from the first step (the ``tiny`` run's exact-match
reward is 0 throughout), so the adapters move."""


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "digits_reward.py"
    path.write_text(DIGITS_REWARD)
    return f"{path}:digits"


def tiny(reward, steps=4):
    config = run_config.load("tiny")
    task = dataclasses.replace(config.task, rewards=(reward,))
    return dataclasses.replace(config, lora=run_config.LoraSpec(rank=RANK), steps=steps, task=task)


def stored_paths(checkpoint_dir):
    """The array paths a checkpoint holds, from orbax's tree metadata."""
    metadata = json.loads((checkpoint_dir / "state" / "_METADATA").read_text())
    return ["/".join(ast.literal_eval(key)) for key in metadata["tree_metadata"]]


# ----------------------------------------------------------------------------------------
# Settings


def test_a_lora_table_and_lora_flags_set_the_adapters(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[lora]\nrank = 8\nalpha = 16\ntargets = ["q_proj", "v_proj"]\nrslora = true\n')
    config = run_config.load(path)
    assert config.lora.build() == models.LoraConfig(rank=8, alpha=16, targets=("q_proj", "v_proj"), rslora=True)
    assert run_config.from_dict(run_config.to_dict(config)) == config  # config.json round-trips
    flags = ["--run-dir", "unused", "--lora.rank", "16", "--lora.targets", "gate_proj", "up_proj"]
    assert cli.parse_train(flags)[1].lora.build() == models.LoraConfig(rank=16, targets=("gate_proj", "up_proj"))
    assert run_config.RunConfig().lora.build() is None  # rank 0: every weight trained
    assert run_config.LoraSpec(rank=2).build().targets == models.config.LORA_TARGETS  # all-linear


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("rank = -1", r"LoraSpec: `rank` must be .*>= 0"),
        ('targets = ["qproj"]', r"LoraSpec: `targets` must be 'all-linear' or names from 'q_proj'"),
        ('targets = ["all-linear", "q_proj"]', r"\['all-linear'\] or projection names, not both"),
        ('dtype = "float16"', r"lora.dtype must be one of 'float32', 'bfloat16'; got 'float16'"),
        ("alpha = 0", r"LoraSpec: `alpha` must be a number > 0"),
        ("ranks = 4", r"unknown key 'ranks' \(did you mean 'rank'\?\)"),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field_and_the_allowed_values(tmp_path, table, message):
    path = tmp_path / "run.toml"
    path.write_text(f"[lora]\n{table}\n" + ("" if table.startswith("rank") else "rank = 4\n"))
    with pytest.raises(ValueError, match=message):
        run_config.load(path)


def test_lora_settings_without_a_rank_are_refused_not_ignored():
    with pytest.raises(ValueError, match=r"LoraSpec: dropout set without `rank`: LoRA is off at rank 0"):
        run_config.LoraSpec(dropout=0.1)
    with pytest.raises(ValueError, match=r"LoraSpec: `dropout` must be a number in \[0, 1\)"):
        run_config.LoraSpec(dropout=2.0)


@pytest.mark.slow
def test_a_ppo_lora_run_checkpoints_its_critics_adapters_not_a_copy_of_the_base(tmp_path, reward):
    config = dataclasses.replace(tiny(reward, steps=2), method="ppo", algorithm=algorithms.get("ppo"))
    result = runs.train_run(config, tmp_path / "run", progress=False, stream=None)
    paths = stored_paths(tmp_path / "run" / CHECKPOINTS / "2")
    critic = [path for path in paths if path.startswith("critic_params/")]
    assert critic and all(path.split("/")[-2].endswith(("_lora_a", "_lora_b")) or "/head/" in path for path in critic)
    _, _, _, params, step = runs.restore_policy(tmp_path / "run")
    assert step == 2 and np.isfinite(result.history[-1]["value_loss"])


def test_a_continued_run_may_not_change_its_adapters(reward):
    stored = tiny(reward)
    changed = dataclasses.replace(stored, lora=run_config.LoraSpec(rank=8))
    assert differences(stored, changed, ignore=RUN_MANAGEMENT) == ["lora.rank: 4 -> 8"]


# ----------------------------------------------------------------------------------------
# A run in a directory


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, reward):
    """A ``tiny`` LoRA run of 4 steps, then continued to 6; and the straight 6-step run."""
    root = tmp_path_factory.mktemp("lora-run")
    continued = runs.train_run(tiny(reward, steps=4), root / "continued", progress=False, stream=None)
    continued = runs.train_run(tiny(reward, steps=6), root / "continued", progress=False, stream=None)
    straight = runs.train_run(tiny(reward, steps=6), root / "straight", progress=False, stream=None)
    return root, continued, straight


@pytest.mark.slow
def test_a_lora_run_checkpoints_only_the_adapters_and_keeps_its_base_once(lora_run):
    root, _, straight = lora_run
    run_dir = root / "straight"
    for step in complete_checkpoints(run_dir):
        paths = stored_paths(run_dir / CHECKPOINTS / str(step))
        params = [path for path in paths if path.startswith("params/")]
        assert params and all(path.split("/")[-2].endswith(("_lora_a", "_lora_b")) for path in params), params
        assert not any(path.startswith("frozen") for path in paths)
        assert not any(path.startswith("ref_params/") for path in paths)  # its reference: adapters of zeros
    record = json.loads((run_dir / BASE_FILE).read_text())
    assert record["path"] is None  # the built-in model, warm-started: stored in base/
    base = load_base(run_dir, straight.config, build.run_task(straight.config))
    chex.assert_trees_all_equal(base, straight.base)  # bitwise what the run trained over
    assert record["digests"] == training.checkpoint.digests(straight.base)
    _, _, model, params, step = runs.restore_policy(run_dir)
    assert step == 6 and model.config.lora == straight.config.lora.build()
    chex.assert_trees_all_equal(params, training.policy_params(straight.state, base=straight.base))


@pytest.mark.slow
def test_a_continued_lora_run_ends_where_the_straight_run_does(lora_run):
    root, continued, straight = lora_run
    chex.assert_trees_all_equal(continued.state.params, straight.state.params)  # bitwise
    chex.assert_trees_all_equal(continued.state.opt_state, straight.state.opt_state)
    chex.assert_trees_all_equal(continued.base, straight.base)
    assert without_timings(runs.read_metrics(root / "continued")) == without_timings(
        runs.read_metrics(root / "straight")
    )
    b_matrices = [leaf for path, leaf in nnx.to_flat_state(straight.state.params) if path[-1].endswith("_lora_b")]
    assert all(bool(jnp.any(b[...] != 0)) for b in b_matrices)  # every B moved from its zero start


@pytest.mark.slow
def test_a_lora_run_that_died_before_its_first_checkpoint_starts_again(lora_run, tmp_path, reward):
    import shutil

    root, _, straight = lora_run
    run_dir = tmp_path / "died"
    shutil.copytree(root / "straight", run_dir)
    shutil.rmtree(run_dir / CHECKPOINTS)  # steps logged, no checkpoint: the run starts over
    again = runs.train_run(tiny(reward, steps=6), run_dir, progress=False, stream=None)
    chex.assert_trees_all_equal(again.state.params, straight.state.params)
    chex.assert_trees_all_equal(load_base(run_dir, again.config, build.run_task(again.config)), again.base)

    (run_dir / BASE_FILE).write_text('{"path": null}')
    with pytest.raises(RunDirectoryError, match=r"base.json.* cannot be used: it must hold `path` and `digests`"):
        runs.restore_policy(run_dir)
    (run_dir / BASE_FILE).unlink()
    with pytest.raises(RunDirectoryError, match=r"base.json.* cannot be used: .*No such file"):
        runs.restore_policy(run_dir)


@pytest.mark.slow
def test_export_writes_the_merged_model_or_the_adapters_in_pefts_format(lora_run, tmp_path, capsys):
    root, _, straight = lora_run
    run_dir = root / "straight"
    _, task, model, params, _ = runs.restore_policy(run_dir)
    tokens = jnp.asarray(task.tokenizer(["u:Solve 1 + 2\na:3"])["input_ids"])
    logits = models.forward(model, params, tokens)

    assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "merged")]) == 0
    merged_model, merged = models.from_pretrained(tmp_path / "merged", jnp.float32)
    np.testing.assert_allclose(models.forward(merged_model, merged, tokens), logits, atol=2e-5, rtol=0)

    assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert "Exported the adapters of step 6" in capsys.readouterr().out
    config = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert config["r"] == RANK and config["base_model_name_or_path"] == "base"  # beside it, wherever it goes
    base_model, base = models.from_pretrained(tmp_path / "adapter" / "base", jnp.float32)
    chex.assert_trees_all_equal(base, lora.split(params)[0])  # the warm-started base, as it is
    loaded_model, adapters = lora.load_adapter(tmp_path / "adapter", base_model)
    chex.assert_trees_all_equal(adapters, straight.state.params)
    np.testing.assert_array_equal(models.forward(loaded_model, lora.combine(base, adapters), tokens), logits)


def test_export_adapter_of_a_run_without_lora_is_refused_before_reading_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / CONFIG_FILE).write_text(json.dumps(run_config.to_dict(run_config.load("tiny"))))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "out"), "--adapter"])
    assert exit_.value.code == 2 and "trained every weight (lora.rank = 0)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_lora_run_over_a_model_directory_references_it_and_refuses_changed_weights(tmp_path, capsys, reward):
    config = dataclasses.replace(tiny(reward, steps=2), warm_start=run_config.WarmStartConfig())
    task = build.run_task(config)
    model, params = build.model(config, task)
    base_dir = tmp_path / "base-model"
    models.save_pretrained(base_dir, model, params, tokenizer=task.tokenizer)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(base_dir)))
    run_dir = tmp_path / "run"
    result = runs.train_run(config, run_dir, progress=False, stream=None)
    assert json.loads((run_dir / BASE_FILE).read_text())["path"] == str(base_dir)
    assert not (run_dir / BASE_CHECKPOINT).exists()  # referenced, not copied
    chex.assert_trees_all_equal(load_base(run_dir, config, task), result.base)

    flat = dict(nnx.to_flat_state(params))
    up = ("layers", 0, "mlp", "up_proj")
    flat[up] = flat[up].replace(flat[up][...] * 1.001)
    changed = nnx.from_flat_state(flat)
    models.save_pretrained(base_dir, model, changed, tokenizer=task.tokenizer)
    message = r"is not the one it started from: 1 of its arrays differ .* \(layers/0/mlp/up_proj/value\)"
    with pytest.raises(RunDirectoryError, match=message):
        runs.train_run(dataclasses.replace(config, steps=4), run_dir, progress=False, stream=None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", "--run-dir", str(run_dir)])
    assert exit_.value.code == 2 and "is not the one it started from" in capsys.readouterr().err

    # The same weights under another config, or with two token ids swapped, are another base too.
    models.save_pretrained(base_dir, model, params, tokenizer=task.tokenizer)
    config_file = base_dir / "config.json"
    original = config_file.read_text()
    config_file.write_text(json.dumps({**json.loads(original), "rms_norm_eps": 1e-3}))
    with pytest.raises(RunDirectoryError, match="its config changed since"):
        runs.train_run(dataclasses.replace(config, steps=4), run_dir, progress=False, stream=None)
    config_file.write_text(original)
    tokenizer_file = base_dir / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    (a, i), (b, j) = list(vocab.items())[5:7]
    vocab[a], vocab[b] = j, i
    tokenizer_file.write_text(json.dumps(tokenizer))
    with pytest.raises(RunDirectoryError, match="its tokenizer changed since"):
        runs.train_run(dataclasses.replace(config, steps=4), run_dir, progress=False, stream=None)


def test_a_run_goes_on_training_a_peft_adapter_with_the_base_as_reference(tmp_path, reward):
    base = dataclasses.replace(tiny(reward, steps=2), warm_start=run_config.WarmStartConfig())
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, reference_metrics=True))
    task = build.run_task(base)
    model, params = build.model(base, task)
    models.save_pretrained(tmp_path / "base-model", model, params, tokenizer=task.tokenizer)
    sft_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=2, alpha=4.0, targets=("q_proj",)),
                                            jax.random.key(1))  # fmt: skip
    adapters = perturbed(adapters, scale=0.1)
    lora.save_adapter(tmp_path / "sft", sft_model, lora.combine(params, adapters))  # someone's SFT adapter
    model_spec = dataclasses.replace(base.model, path=str(tmp_path / "base-model"))
    config = dataclasses.replace(base, model=model_spec, lora=run_config.LoraSpec(adapter=str(tmp_path / "sft")))
    result = runs.train_run(config, tmp_path / "run", progress=False, stream=None)
    stored = run_config.from_dict(json.loads((tmp_path / "run" / CONFIG_FILE).read_text()))
    assert (stored.lora.rank, stored.lora.alpha, stored.lora.targets) == (2, 4.0, ("q_proj",))
    assert result.history[0]["kl_k3"] > 0  # step 0's policy is the adapter's, the reference the base
    chex.assert_trees_all_equal(result.base, params)

    with pytest.raises(ValueError, match=r"lora.rank = 8 \(the adapter's: 2\)"):
        runs.train_run(dataclasses.replace(config, lora=run_config.LoraSpec(adapter=str(tmp_path / "sft"), rank=8)),
                       tmp_path / "other", progress=False, stream=None)  # fmt: skip
    with pytest.raises(ValueError, match="a warm start would change the base under it"):
        dataclasses.replace(config, warm_start=run_config.WarmStartConfig(steps=5))


# ----------------------------------------------------------------------------------------
# Killed and resumed


@pytest.mark.slow
def test_a_lora_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_runs_adapters(tmp_path, reward):
    env = environment()
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    flags = ("--lora.rank", str(RANK), "--task.rewards", reward)
    subprocess.run(command(reference, *flags), env=env, check=True, capture_output=True, timeout=600)

    process = subprocess.Popen(command(killed, *flags), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert stop_after_a_checkpoint(process, killed, signal.SIGKILL) == -signal.SIGKILL
    saved = complete_checkpoints(killed)
    assert saved and saved[-1] < len(runs.read_metrics(killed)), process.stderr.read().decode()[-2000:]

    resumed = subprocess.run(command(killed, "--resume", *flags), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from its checkpoint of step {saved[-1]}" in resumed.stdout
    assert without_timings(runs.read_metrics(killed)) == without_timings(runs.read_metrics(reference))
    *_, reference_params, _ = runs.restore_policy(reference)
    *_, resumed_params, step = runs.restore_policy(killed)
    assert step == 12
    chex.assert_trees_all_equal(resumed_params, reference_params)  # bitwise, adapters and base


# ----------------------------------------------------------------------------------------
# An int8 base


def test_an_int8_base_without_lora_is_refused_before_any_compute(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nquantization = "int8"\n')
    with pytest.raises(ValueError, match=r"model.quantization = 'int8' stores a frozen base, .* set lora.rank"):
        run_config.load(path)


@pytest.mark.slow
def test_a_lora_run_over_an_int8_base_quantizes_after_the_warm_start_and_reads_it_back(tmp_path, reward):
    config = tiny(reward, steps=2)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, quantization="int8"))
    run_dir = tmp_path / "run"
    result = runs.train_run(config, run_dir, progress=False, stream=None)
    kernels = {path: leaf for path, leaf in nnx.to_flat_state(result.base) if path[-1] in KERNELS}
    assert kernels and all(leaf[...].dtype == jnp.int8 for leaf in kernels.values())
    assert json.loads((run_dir / BASE_FILE).read_text())["path"] is None  # warm-started, then quantized
    _, task, model, params, _ = runs.restore_policy(run_dir)
    assert model.config.quantization == "int8"
    chex.assert_trees_all_equal(lora.split(params)[0], result.base)

    # The merged export is the dequantized base plus s A B: the same logits up to rounding.
    assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "merged")]) == 0
    merged_model, merged = models.from_pretrained(tmp_path / "merged", jnp.float32)
    ids = jnp.asarray(task.tokenizer(["u:Solve 1 + 2\na:3"])["input_ids"])
    np.testing.assert_allclose(models.forward(merged_model, merged, ids), models.forward(model, params, ids), atol=1e-4)
