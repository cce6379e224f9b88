"""The ``jaxrl-llm`` command line: flags generated from the configs, config files, bad
input refused before any compute, and a whole run (Ctrl-C, resume, eval, export) on the
``tiny`` config."""

import dataclasses
import json
import re
import subprocess
import sys
import tomllib

import pytest
import transformers

from jaxrl_llm import algorithms, cli, runs, training
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs import records, run
from jaxrl_llm.runs.directory import CHECKPOINTS
from jaxrl_llm.training import loop


def parse(*argv, run_dir="unused-run-dir"):
    return cli.parse_train(["--run-dir", str(run_dir), *argv])[1]


def test_flags_parse_booleans_optionals_literals_tuples_and_nested_fields():
    config = parse(
        "--train.share-prompts",
        "False",
        "--train.minibatch-size",
        "16",
        "--train.top_p",
        "0.9",
        "--model.param-dtype",
        "bfloat16",
        "--task.operators",
        "+",
        "-",
        "--steps",
        "7",
        "--algorithm.eps-high",
        "0.3",
    )
    assert (
        config.train.share_prompts is False and config.train.minibatch_size == 16 and config.train.sampling.top_p == 0.9
    )
    assert config.model.param_dtype == "bfloat16" and config.task.operators == ("+", "-") and config.steps == 7
    assert config.algorithm.eps_high == 0.3 and config.algorithm.advantage == "grpo"
    assert parse("--train.minibatch-size", "None", "--train.share-prompts", "True").train.minibatch_size is None
    # Unset fields keep the run's defaults (not TrainConfig()'s).
    assert parse().train == runs.RunConfig().train and parse() == runs.RunConfig()


def test_grouped_train_settings_take_their_group_flags_and_their_flat_ones():
    grouped = parse(
        "--train.sampling.temperature",
        "0.7",
        "--train.sampling.max-new-tokens",
        "2",
        "--train.optimizer.learning-rate",
        "1e-5",
        "--train.optimizer.lr_schedule",
        "cosine",
    )
    flat = parse(
        "--train.temperature",
        "0.7",
        "--train.max_new_tokens=2",
        "--train.learning-rate",
        "1e-5",
        "--train.lr-schedule=cosine",
    )
    assert grouped == flat
    assert grouped.train.sampling == training.config.SamplingConfig(temperature=0.7, max_new_tokens=2)
    assert grouped.train.optimizer == dataclasses.replace(
        runs.RunConfig().train.optimizer, learning_rate=1e-5, lr_schedule="cosine"
    )


def test_method_picks_the_preset_and_config_files_override_it(tmp_path):
    assert parse("--method", "dapo").algorithm == algorithms.DAPO
    path = tmp_path / "run.toml"
    path.write_text('method = "ppo"\nsteps = 3\n[algorithm]\nkl_reward_coef = 0.05\n[train]\nlearning_rate = 1e-5\n')
    config = parse("--config", str(path), "--train.num-prompts", "4")
    assert config.algorithm == dataclasses.replace(algorithms.PPO, kl_reward_coef=0.05)
    assert (config.steps, config.train.optimizer.learning_rate, config.train.num_prompts) == (3, 1e-5, 4)
    assert config.train.group_size == runs.RunConfig().train.group_size  # the run's default, not TrainConfig()'s
    # --method replaces the file's preset; the file's [algorithm] table applies to it.
    assert parse("--config", str(path), "--method", "reinforce++").algorithm == dataclasses.replace(
        algorithms.REINFORCE_PP, kl_reward_coef=0.05
    )


def test_conventions_give_the_method_a_peers_numerics_and_explicit_fields_win(tmp_path):
    assert parse("--method", "dr-grpo", "--conventions", "verl").algorithm == algorithms.DR_GRPO.matching("verl")
    assert parse("--conventions", "trl", "--algorithm.advantage-eps", "0.01").algorithm == dataclasses.replace(
        algorithms.GRPO.matching("trl"), advantage_eps=0.01
    )
    path = tmp_path / "run.toml"
    path.write_text('method = "ppo"\nconventions = "openrlhf"\n[algorithm]\nkl_clamp = 5.0\n')
    assert parse("--config", str(path)).algorithm == dataclasses.replace(
        algorithms.PPO.matching("openrlhf"), kl_clamp=5.0
    )
    assert parse("--config", str(path), "--conventions", "verl").algorithm == dataclasses.replace(
        algorithms.PPO.matching("verl"), kl_clamp=5.0
    )
    path.write_text('conventions = "tunix"\n')
    with pytest.raises(
        cli.UsageError,
        match=r"conventions: Algorithm.matching: `library` must be one of 'trl', "
        r"'verl', 'openrlhf'; got 'tunix'",
    ):
        parse("--config", str(path))
    with pytest.raises(SystemExit) as exit_info:
        parse("--conventions", "tunix")
    assert exit_info.value.code == 2


def test_the_toy_config_file_is_run_config_default_and_every_named_config_loads():
    assert run_config.load("toy") == runs.RunConfig()
    for path in run_config.CONFIG_DIRECTORY.glob("*.toml"):
        run_config.load(path)
    tiny = run_config.load("tiny")
    assert tiny.model.path is None and tiny.task.name == "arithmetic" and tiny.steps < 10


@pytest.mark.parametrize(
    "flags",
    [
        ("--method", "ppo", "--train.top-k", "5", "--task.operators", "+", "*"),
        ("--algorithm.eps-high", "0.3", "--algorithm.kl-coef", "0.5"),
    ],
)  # the default method
def test_a_stored_config_loads_back_to_the_same_run_config(flags):
    config = parse(*flags)
    assert run_config.from_dict(json.loads(json.dumps(run_config.to_dict(config)))) == config
    assert run_config.from_dict({"algorithm": {"eps_high": 0.3}}).algorithm.eps_high == 0.3


@pytest.mark.parametrize(
    "content, message",
    [
        ('tensorboard = "no"', "config.tensorboard must be true or false; got 'no'"),
        ('[task]\nrewards = "exact_match"', "config.task.rewards must be a list"),
        ("[train]\nseed = true", "config.train.seed must be an integer; got True"),
        ('[model]\nparam_dtype = "fp16"', "must be one of 'float32', 'bfloat16'; got 'fp16'"),
        ('[task]\noperators = ["+", 2]', "config.task.operators[1] must be a string; got 2"),
        ("steps = 0", "`steps` must be an integer >= 1"),
        (
            "[train]\ntemperature = 0.5\n[train.sampling]\ntemperature = 0.4",
            "config.train: `temperature` is given twice, as config.train.temperature and "
            "config.train.sampling.temperature",
        ),
        (
            "[train.optimizer]\nlearning_rat = 1e-5",
            "config.train.optimizer: unknown key 'learning_rat' (did you mean 'learning_rate'?)",
        ),
        ("[train.sampling]\ntemperature = 0.0", "TrainConfig: `sampling.temperature` must be a finite number > 0"),
    ],
)
def test_config_file_values_of_the_wrong_type_are_refused(content, message, tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        run_config.from_dict(tomllib.loads(path.read_text()))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus", "1"], "Unrecognized options: --bogus"),
        (["--train.share-prompts", "maybe"], "True"),
        (["--algorithm.eps-low", "-0.1"], "eps_low"),
        (["--train.group-size", "1"], "group_size >= 2"),
        (["--method", "rloo", "--train.group-size", "1"], "group_size >= 2"),
        (["--train.minibatch-size", "5"], "must divide the batch"),
        (["--train.num-prompts", "0"], "num_prompts"),
        (["--method", "grpo++"], "Unknown algorithm 'grpo++'; known: pg, "),
        (["--config", "no-such-config"], "no config named 'no-such-config'"),
        (["--model.path", "/no/such/model"], "is neither a GGUF file nor a directory"),
        (["--model.path", "/no/such/model.gguf"], "model.path: No GGUF file at /no/such/model.gguf"),
        (["--task.name", "jsonl"], "set task.path"),
        (["--task.rewards", "exact_matc"], "unknown reward 'exact_matc'; the built-in ones are exact_match"),
        (["--train.max-new-tokens", "100000"], "= 100512 positions, more than the built-in model takes"),
        (["--train.seed", "-1"], "seed"),
        (["--train.seed", str(10**20)], "`seed` must be an integer in [0, 2**63 - 1]; got 100000000000000000000"),
        (
            ["--model.hidden-size", "10000000", "--model.num-heads", "1", "--model.num-kv-heads", "1"],
            "GiB of memory. Make the model smaller",
        ),  # fmt: skip
        (["--train.sampling.top-p", "0"], "SamplingConfig: `top_p` must be in (0.0, 1.0]; got 0.0"),
        (["--train.top-p", "0"], "SamplingConfig: `top_p` must be in (0.0, 1.0]; got 0.0"),
        (["--train.optimizer.adam-b1", "1"], "OptimizerConfig: `adam_b1` must be in [0.0, 1.0); got 1.0"),
    ],
)
def test_bad_settings_exit_with_status_2_and_a_message_before_any_compute(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run.build, "model", lambda *a, **k: pytest.fail("compute started"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--run-dir", str(tmp_path / "run"), *argv])
    assert exit_.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split()).replace("│ ", "").replace(" │", "")
    assert not (tmp_path / "run").exists()


def test_a_json_config_that_is_not_an_object_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "list.json"
    path.write_text('[{"steps": 3}]')
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert f"{path}: a run config is an object of settings" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(ValueError, match="a run config is a table"):
        run_config.from_dict([{"steps": 3}])


def test_an_unknown_key_in_a_config_file_names_the_allowed_keys(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlearning_rat = 1e-5\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key 'learning_rat'" in err and "learning_rate" in err and "bad.toml.train" in err


def test_a_directory_holding_something_else_is_not_touched_without_overwrite(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--run-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "not a run directory" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit):
        cli.main(["train", "--run-dir", str(tmp_path), "--overwrite"])  # --overwrite replaces run directories only
    assert "not a run directory" in capsys.readouterr().err and (tmp_path / "notes.txt").is_file()
    with pytest.raises(SystemExit):
        cli.main(["train", "--run-dir", str(tmp_path / "new"), "--resume"])
    assert "holds no run to resume" in capsys.readouterr().err


def test_listings_and_the_module_entry_point(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in algorithms.PRESETS)
    assert cli.main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in run_config.TASKS) and "math_equivalence" in out
    assert cli.main(["nonsense"]) == 2
    help_ = subprocess.run([sys.executable, "-m", "jaxrl_llm", "train", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0
    assert "--run-dir" in help_.stdout and "--train.optimizer.learning-rate" in help_.stdout
    assert "Peak AdamW learning rate of the policy" in help_.stdout  # the field's docstring


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A ``tiny`` run interrupted (KeyboardInterrupt) in its evaluation after step 3, then
    continued to the end by the same command."""
    base = tmp_path_factory.mktemp("cli")
    run_dir = base / "run"
    argv = ["train", "--config", "tiny", "--run-dir", "run", "--progress", "off", "--steps", "5"]  # relative
    evaluate = loop.evaluation_metrics
    calls = []

    def interrupting(*args, **kwargs):  # the warm start is evaluated, then steps 1 and 3 (eval_every=2)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(base)
        patch.setattr(loop, "evaluation_metrics", interrupting)
        interrupted = cli.main(argv)
        checkpoints = training.Checkpointer(run_dir / CHECKPOINTS).all_steps()
        logged = [row["step"] for row in runs.read_metrics(run_dir)]
        patch.undo()
        patch.chdir(base)
        finished = cli.main(argv)  # the same command again continues the run
    return run_dir, interrupted, checkpoints, logged, finished


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_the_same_command_continues_the_run(finished_run, capsys):
    run_dir, interrupted, checkpoints, logged, finished = finished_run
    assert interrupted == 130 and checkpoints == [2, 4]  # save_every=2; the interrupted step completed
    assert logged == [0, 1, 2, 3] and finished == 0  # step 3 was recorded without its interrupted evaluation,
    assert "eval_greedy_accuracy" in runs.read_metrics(run_dir)[3]  # which the continued run made up
    assert [row["step"] for row in runs.read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    assert training.Checkpointer(run_dir / CHECKPOINTS).latest_step() == 5
    assert (run_dir / records.PLOT_FILE).is_file() and list((run_dir / records.TENSORBOARD_DIR).iterdir())
    # A changed setting is another run: refused, nothing touched.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--run-dir", str(run_dir), "--train.learning-rate", "0.5"])
    assert exit_.value.code == 2
    assert "holds a different run" in capsys.readouterr().err
    assert len(runs.read_metrics(run_dir)) == 5


@pytest.mark.slow
def test_eval_and_export_of_a_run(finished_run, tmp_path, capsys):
    run_dir = finished_run[0]
    for step in (2, 4):  # training evaluated the same params after its steps 1 and 3, with the same seed
        assert cli.main(["eval", "--run-dir", str(run_dir), "--step", str(step)]) == 0
        out = capsys.readouterr().out
        assert "eval_greedy_accuracy" in out and "eval_pass@2" in out
        saved = json.loads((run_dir / "eval" / f"step-{step}.json").read_text())
        assert saved["step"] == step and saved["eval_examples"] == 8  # the tiny task's 8 held-out expressions
        during_training = runs.read_metrics(run_dir)[step - 1]
        assert {k: v for k, v in saved.items() if k.startswith("eval_") and k != "eval_seconds"} == {
            k: v for k, v in during_training.items() if k.startswith("eval_") and k != "eval_seconds"
        }
    assert cli.main(["eval", "--run-dir", str(run_dir), "--num-samples", "4"]) == 0
    assert json.loads((run_dir / "eval" / "step-5.json").read_text())["eval_pass@4"] >= 0

    out_dir = tmp_path / "exported"
    assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(out_dir), "--step", "4"]) == 0
    with pytest.raises(SystemExit) as exit_:  # an existing export, or a path in the run directory: refused
        cli.main(["export", "--run-dir", str(run_dir), "--out", str(out_dir)])
    assert exit_.value.code == 2 and "exists and is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--run-dir", str(run_dir), "--out", str(run_dir / "policy")])
    assert exit_.value.code == 2 and "lies in the run directory" in capsys.readouterr().err
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    generation = transformers.GenerationConfig.from_pretrained(out_dir)
    assert (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Solve 1 + 2"}], tokenize=False, add_generation_prompt=True
        )
        == "u:Solve 1 + 2\na:"
    )
    assert tokenizer.eos_token_id in (
        [generation.eos_token_id] if isinstance(generation.eos_token_id, int) else generation.eos_token_id
    )
    assert model.config.vocab_size == len(tokenizer)

    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--run-dir", str(run_dir), "--out", str(out_dir), "--step", "1", "--overwrite"])
    assert exit_.value.code == 2 and "no checkpoint of step 1" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_of_an_exported_model_directory_matches_the_runs_evaluation(finished_run, tmp_path, capsys):
    run_dir = finished_run[0]
    assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "policy")]) == 0
    assert cli.main(["eval", "--run-dir", str(run_dir), "--out", str(tmp_path / "run.json")]) == 0
    assert (
        cli.main(
            ["eval", "--model", str(tmp_path / "policy"), "--config", "tiny", "--out", str(tmp_path / "model.json")]
        )
        == 0
    )
    from_run = json.loads((tmp_path / "run.json").read_text())
    from_model = json.loads((tmp_path / "model.json").read_text())
    assert {k: v for k, v in from_model.items() if k != "eval_seconds"} == {
        k: v for k, v in from_run.items() if k not in ("step", "eval_seconds")
    }
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", "--model", str(tmp_path / "missing")])
    assert exit_.value.code == 2 and "is neither a GGUF file nor a directory" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's leftover asyncio reads
def test_a_corrupt_latest_checkpoint_is_reported_and_the_previous_one_used(finished_run, tmp_path):
    import shutil
    import warnings

    run_dir = tmp_path / "copy"
    shutil.copytree(finished_run[0], run_dir)
    latest = run_dir / CHECKPOINTS / "5"
    for path in latest.rglob("*"):
        if path.is_file() and path.suffix not in (".txt",) and "METADATA" not in path.name:
            path.write_bytes(b"")  # truncated arrays
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        *_, step = runs.restore_policy(run_dir)
    assert step == 4
    assert any("checkpoint 5" in str(w.message) and "falling back to checkpoint 4" in str(w.message) for w in caught)


def test_while_a_run_writes_its_files_orbax_storage_errors_are_muted_and_other_errors_kept():
    """orbax's writer threads log every failed write of a full or read-only disk through absl
    (hundreds of lines for one checkpoint); the run reports the failure itself in one line."""
    import logging

    absl = logging.getLogger("absl")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    absl.addHandler(handler)
    try:
        with cli._storage_noise_muted():
            absl.error("Error writing checkpoint: [Errno 30] Read-only file system: 'run/checkpoints/4'")
            absl.error('PERMISSION_DENIED: Error opening "run/checkpoints/4/d/0" for writing')
            absl.error("RESOURCE_EXHAUSTED: Failed to write 312 bytes: No space left on device")
            absl.warning("Waiting for previous save to complete took 17.56 seconds")
            absl.error("a reward server is unreachable")
        absl.error("after the run")
    finally:
        absl.removeHandler(handler)
    assert seen == ["a reward server is unreachable", "after the run"]
