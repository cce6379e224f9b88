"""A GGUF checkpoint as ``model.path``, through the command line: a run trains it, prints its
progress as lines when its output is not a terminal, evaluates its last step, exports it as a
GGUF file (merged, for LoRA too) that loads back; bad exports are refused by name."""

import json
import re

import chex
import gguf
import numpy as np
import pytest

from jaxrl_llm import cli, evaluation, models, runs
from jaxrl_llm.runs.directory import BASE_CHECKPOINT, BASE_FILE, RunDirectoryError
from jaxrl_llm.runs.export import export_run
from jaxrl_llm.runs.policy import restore_policy
from tests.models import gguf_fixtures as fixtures

RUN = """
steps = 3
save_every = 2
plot_every = 3

[model]
path = "{model}"

[task]
name = "arithmetic"
prompt_format = "What is {{expression}}?"
test_size = 6

[algorithm]
kl_coef = 0.0

[train]
num_prompts = 2
group_size = 2
eval_every = 2
eval_samples = 0

[train.sampling]
max_new_tokens = 4
"""


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    tokenizer = fixtures.bpe_tokenizer()
    hf_model = fixtures.tiny_gguf_hf_model("llama", tokenizer, num_hidden_layers=1)
    return fixtures.write_gguf(directory / "tiny.Q8_0.gguf", hf_model, tokenizer, qtype="Q8_0")


@pytest.fixture(scope="module")
def trained(gguf_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("run")
    (directory / "run.toml").write_text(RUN.format(model=gguf_model))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        status = cli.main(["train", "--config", "run.toml", "--run-dir", "run"])
    return directory, status


@pytest.mark.slow
def test_a_gguf_model_trains_with_progress_lines_and_its_last_step_evaluated(trained, gguf_model, capsys):
    directory, status = trained
    assert status == 0
    metrics = runs.read_metrics(directory / "run")
    assert [row["step"] for row in metrics] == [0, 1, 2]
    assert [row["step"] for row in metrics if "eval_greedy_accuracy" in row] == [1, 2]  # every 2, and the last
    config = runs.load(directory / "run.toml")
    task = runs.build.run_task(config)
    tokenizer = models.load_tokenizer(gguf_model)
    assert task.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert task.eos_ids == (tokenizer.eos_token_id,)  # the file's EOS, ChatML's end of turn
    first = task.examples("test", np.arange(1), seed=0)
    assert tokenizer.decode(first.tokens[0][first.mask[0]]).startswith("<|im_start|>user\n")


def test_progress_lines_name_the_step_reward_time_and_held_out_accuracy():
    rows = [
        {"step": 0, "reward": 0.25, "completion_length": 3.0, "step_seconds": 12.0},
        {"step": 1, "reward": 0.5, "completion_length": 2.5, "step_seconds": 2.0},
        {"step": 2, "reward": 0.75, "completion_length": 2.0, "step_seconds": 4.0, **{"eval_greedy_accuracy": 0.5}},
    ]
    rows[2].update(eval_examples=200.0, eval_seconds=31.2)
    assert runs.records.step_line(rows[:2], total_steps=5) == (
        "step 2/5  reward 0.5  length 2.5  2 s/step  0:00:06 left"  # 3 steps at 2 s (the first step left out)
    )
    assert runs.records.step_line(rows, total_steps=3) == (
        "step 3/3  reward 0.75  length 2  4 s/step  held-out 0.50 (95% CI 0.43-0.57, n=200) in 31 s"
    )


@pytest.mark.parametrize(("successes", "trials"), [(132, 200), (3, 20), (0, 10), (10, 10)])
def test_the_wilson_interval_is_the_score_test_inverted(successes, trials):
    """Wilson's interval holds the p whose score test |p_hat - p| <= z sqrt(p (1 - p) / n) passes:
    its ends found by bisection from that definition alone."""
    z, observed = 1.959964, successes / trials

    def boundary(inside: float, outside: float) -> float:
        for _ in range(100):
            middle = (inside + outside) / 2
            passes = abs(observed - middle) <= z * np.sqrt(middle * (1 - middle) / trials)
            inside, outside = (middle, outside) if passes else (inside, middle)
        return inside

    low, high = evaluation.wilson_interval(successes, trials)
    np.testing.assert_allclose([low, high], [boundary(observed, 0.0), boundary(observed, 1.0)], atol=1e-9)
    with pytest.raises(ValueError, match="trials"):
        evaluation.wilson_interval(0, 0)


@pytest.mark.slow
def test_the_cli_prints_a_line_a_step_when_its_output_is_no_terminal(gguf_model, tmp_path, capfd):
    (tmp_path / "run.toml").write_text(RUN.format(model=gguf_model))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert cli.main(["train", "--config", "run.toml", "--run-dir", "run", "--steps", "2"]) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[0] == "Evaluating on the 6 held-out prompts (greedy)..."
    assert out[1].startswith("Before training: held-out greedy accuracy ") and "(95% CI " in out[1]
    assert out[2].startswith("step 1/2  reward ") and out[2].endswith(" s/step")  # no time left known yet
    assert out[3].startswith("step 2/2  reward ") and "held-out " in out[3]
    assert any(line.startswith("Held-out greedy accuracy: ") and "95% intervals" in line for line in out)


@pytest.mark.slow
def test_a_run_exports_as_a_gguf_file_that_reads_back_to_its_policy(trained, tmp_path, capsys):
    directory, _ = trained
    run_dir = directory / "run"
    out = tmp_path / "policy.gguf"
    assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(out), "--format", "gguf", "--type", "f32"]) == 0
    assert capsys.readouterr().out.strip() == f"Exported step 3 of {run_dir} to {out}"
    _, _, _, params, _ = restore_policy(run_dir)
    _, loaded = models.from_pretrained(out)
    chex.assert_trees_all_equal(loaded, params)
    fields = gguf.GGUFReader(out).fields
    assert fields["general.sampling.temp"].contents() == 1.0
    assert fields["tokenizer.ggml.eos_token_id"].contents() == models.load_tokenizer(out).eos_token_id
    again = export_run(run_dir, out, format="gguf", file_type="q8_0", overwrite=True)
    assert again == 3 and {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} == {"F32", "Q8_0"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--type", "q8_0"], "--type sets a GGUF file's type; add --format gguf"),
        (["--format", "gguf"], r"name it with \.gguf \(--out policy\.gguf\)"),
        (["--format", "gguf", "--type", "q4_k"], "invalid choice: 'q4_k'"),
    ],
)
def test_bad_gguf_exports_are_refused_before_reading_the_run(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--run-dir", str(tmp_path / "no-run"), "--out", str(tmp_path / "policy"), *flags])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.slow
def test_a_lora_run_over_a_gguf_base_exports_merged_or_as_peft_adapters_over_a_written_base(
    gguf_model, tmp_path, capsys
):
    (tmp_path / "run.toml").write_text(RUN.format(model=gguf_model) + "\n[lora]\nrank = 4\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert cli.main(["train", "--config", "run.toml", "--run-dir", "run", "--steps", "2", "--progress", "off"]) == 0
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / BASE_FILE).read_text())["path"] == str(gguf_model)  # referenced, not copied
    _, _, model, params, _ = restore_policy(run_dir)
    _, merged = models.lora.merge(model, params)
    export_run(run_dir, tmp_path / "merged.gguf", format="gguf", file_type="f32")
    chex.assert_trees_all_equal(models.from_pretrained(tmp_path / "merged.gguf")[1], merged)
    export_run(run_dir, tmp_path / "adapters", adapter=True)
    adapter_config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == BASE_CHECKPOINT  # beside it, wherever it goes
    with pytest.raises(RunDirectoryError, match="drop --adapter"):
        export_run(run_dir, tmp_path / "x.gguf", adapter=True, format="gguf")
