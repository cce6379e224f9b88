"""The notebooks in notebooks/: committed executed (outputs and plots included, so they read on
GitHub), and each runs top to bottom without error from its own directory, as Jupyter starts it."""

import os
import pathlib
import re
import tomllib

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import default_codegen_environ

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
MAX_BYTES = 1_000_000
"""A committed notebook's size limit: outputs stay modest (no long logs, a few plots)."""
QUICKER = {
    "02_training_a_language_model.ipynb": {"steps=3000": "steps=60", "steps=20, task=task": "steps=2, task=task"},
    "03_your_own_data.ipynb": {"steps=20,": "steps=4,", "eval_every=10": "eval_every=2"},
    "04_tools_and_environments.ipynb": {
        "CalculatorConfig(steps=100, eval_every=25, eval_examples=100,": (
            "CalculatorConfig(steps=4, eval_every=2, eval_examples=8, demonstrations=64, sft_steps=20,"
        )
    },
    "05_a_real_model.ipynb": {
        "STEPS = 20": "STEPS = 1",
        "models.from_pretrained(MODEL)": "models.from_pretrained(MODEL, scan_layers=True)",
        "models.from_pretrained(exported)": "models.from_pretrained(exported, scan_layers=True)",
        "test_size=200": "test_size=16",
        "num_prompts=8, group_size=8,": "num_prompts=2, group_size=2,",
    },
}
"""Settings a notebook runs with here instead of its own (its committed outputs show its own):
fewer training steps, rollouts and held-out examples, enough to run every cell. The real model's 20 GRPO
steps and 200 held-out sums take 8 minutes, 04's calculator run 3. Shortened, the notebooks are
compile-bound: they run with the suite's quick code generation, except those in DEFAULT_CODEGEN,
and the real model's 30 layers are loaded stacked (``scan_layers=True``: each program compiles one
layer; 41 s instead of 64 for the notebook)."""
DEFAULT_CODEGEN = {"05_a_real_model.ipynb"}
"""Notebooks run with XLA's default code generation: the real model's train step gains more from
optimised code than it loses compiling it (05's training cell: 49 s, 66 s with the quick flags)."""


def errors_of(notebook) -> list[str]:
    return [
        f"{o['ename']}: {o['evalue']}"
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:5] == [
        "01_core_methods.ipynb",
        "02_training_a_language_model.ipynb",
        "03_your_own_data.ipynb",
        "04_tools_and_environments.ipynb",
        "05_a_real_model.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_executed(path):
    """Every code cell ran, in order, without an error; the plots are embedded PNGs; the file is small."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "run it top to bottom, then commit"
    assert not errors_of(notebook)
    assert any("image/png" in o.get("data", {}) for cell in code for o in cell.outputs), "no plot in the outputs"
    assert path.stat().st_size < MAX_BYTES


def test_the_config_file_in_03_is_the_run_it_trains():
    """03 shows its run as a TOML file for `jaxrl-llm train`; that file loads to the RunConfig its code trains."""
    from jaxrl_llm import runs, training
    from jaxrl_llm.runs.config import differences, from_dict
    from jaxrl_llm.sampling import SamplingConfig

    notebook = nbformat.read(NOTEBOOK_DIR / "03_your_own_data.ipynb", as_version=4)
    markdown = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    (toml,) = re.findall(r"```toml\n(.*?)```", markdown, flags=re.S)
    (source,) = [
        cell.source
        for cell in notebook.cells
        if cell.cell_type == "code" and cell.source.startswith("config = runs.RunConfig(")
    ]
    namespace = {"runs": runs, "training": training, "SamplingConfig": SamplingConfig}
    exec(source, namespace)
    # The file's [train] starts from RunConfig's default TrainConfig, the code's from TrainConfig's: they differ
    # in the critic's learning rate, which GRPO (no critic) never reads.
    assert not differences(from_dict(tomllib.loads(toml)), namespace["config"], ignore=("train.critic_learning_rate",))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)  # a copy in memory: the committed file is not rewritten
    for old, new in QUICKER.get(path.name, {}).items():
        cells = [cell for cell in notebook.cells if cell.cell_type == "code" and old in cell.source]
        assert len(cells) == 1, f"{path.name}: {old!r} is in {len(cells)} code cells, not 1"
        cells[0].source = cells[0].source.replace(old, new)
    # From notebooks/, the working directory Jupyter gives a notebook there; temporary files
    # (03's project directory) go under tmp_path.
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    environ = default_codegen_environ() if path.name in DEFAULT_CODEGEN else os.environ
    client.execute(env={**environ, "TMPDIR": str(tmp_path)})
    assert not errors_of(notebook)
