"""The code examples of README.md and docs/ run, or are checked, as they are written.

Every fenced block of these pages is either output (```text) or an example: it follows a
``<!-- example: NAME -->`` marker, and a test here or in ``tests/test_readme.py`` runs it.

* Python blocks are executed. An example that leaves arrays or a model to the reader ("with a
  model and left-padded prompts") is given them by the test (:data:`GIVEN`), small, as
  doctest gives globals; nothing in the code is changed but the step counts named in
  :data:`SMALLER`.
* TOML blocks are parsed into a :class:`~jaxrl_llm.runs.RunConfig`.
* bash blocks: ``make`` targets exist in the Makefile; every ``jaxrl-llm train`` command line
  parses to a run config (``cli.parse_train``, which reads configs and checks every flag, and
  starts nothing); ``eval`` and ``export`` name only flags of their ``--help``; ``presets`` and
  ``tasks`` run; ``experiments/compare_methods.py``'s and ``benchmarks/gpu_side_by_side.py``'s
  command lines parse to their flags; a ``pip install`` installs ``make gpu-wheels``' wheels, offline.
* Relative links between the pages point at files and headings that exist.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
import sys
import tomllib
from collections.abc import Callable
from typing import NamedTuple

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, cli, models, runs, training
from jaxrl_llm.runs.config import from_dict
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import DigitSumTask
from tests.models import gguf_fixtures

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- example: (\S+) -->")
LANGUAGES = ("python", "toml", "bash", "text")


class Block(NamedTuple):
    page: str
    name: str | None  # the marker's NAME; None for output (```text)
    language: str
    code: str
    line: int  # of the opening fence, from 1


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``page`` (a path from the repository root), in order."""
    lines = (ROOT / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        line = lines[i]
        assert not re.match(r"\s+```", line), f"{page}:{i + 1}: an indented code fence; fences start a line"
        if line.startswith("```"):
            language = line[3:].strip()
            end = lines.index("```", i + 1)
            marker = MARKER.fullmatch(lines[i - 1]) if i else None
            found.append(Block(page, marker and marker.group(1), language, "\n".join(lines[i + 1 : end]), i + 1))
            i = end
        i += 1
    return found


def example(page: str, name: str, language: str = "python") -> str:
    """The code of the block that follows ``<!-- example: name -->`` in ``page``."""
    matches = [b for b in blocks(page) if b.name == name]
    assert len(matches) == 1, f"{page} has {len(matches)} examples named {name!r}, not one"
    assert matches[0].language == language, f"{page}, {name!r}: a {matches[0].language} block, not {language}"
    return matches[0].code


# --- Python examples ----------------------------------------------------------------------

TINY = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


class _Batch(NamedTuple):
    tokens: jax.Array
    old_logp: jax.Array
    rewards: jax.Array
    mask: jax.Array
    ref_logp: jax.Array


def _core(tmp_path) -> dict:
    """A linear "model" over ``[B, T]`` tokens and a batch of ``P = 2`` prompts x ``G = 4``."""
    P, G, T, V = 2, 4, 5, 7
    rng = np.random.default_rng(0)
    params = {"embed": jnp.asarray(rng.normal(size=(V, V)), jnp.float32)}
    tokens = jnp.asarray(rng.integers(0, V, (P * G, T)))
    logp = jnp.asarray(np.log(rng.dirichlet(np.ones(V), (P * G, T))), jnp.float32)
    old = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    batch = _Batch(
        tokens,
        old,
        jnp.asarray(rng.integers(0, 2, (P, G)), jnp.float32),
        jnp.asarray(rng.integers(0, 2, (P * G, T)), bool).at[:, 0].set(True),
        old - 0.1,
    )
    return dict(apply=lambda params, tokens: params["embed"][tokens], params=params, batch=batch)


def _core_check(namespace: dict, code: str):
    named = re.search(r"# metrics: (.*)", code).group(1)
    names = set()
    for item in named.split(", "):  # "ratio_min/mean/max", "clip_fraction(_low/_high)"
        if "(" in item:
            stem, suffixes = item.rstrip(")").split("(")
            names |= {stem, *(stem + s for s in suffixes.split("/"))}
        elif "/" in item:
            first, *rest = item.split("/")
            stem = first.rsplit("_", 1)[0]
            names |= {first, *(f"{stem}_{r}" for r in rest)}
        else:
            names.add(item)
    assert names <= namespace["metrics"].keys(), names - namespace["metrics"].keys()
    assert np.isfinite(namespace["loss"]) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(namespace["grads"]))


def _random_model(config: models.ModelConfig) -> tuple:
    """A model with random weights drawn by NumPy (``models.init`` draws each leaf eagerly: slower)."""
    model, shapes = models.abstract(config)
    rng = np.random.default_rng(0)
    return model, jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype), shapes)


def _model(tmp_path) -> dict:
    """A tiny random Qwen3-shaped checkpoint at the example's path, and a left-padded batch."""
    config = models.ModelConfig(architecture="qwen3", qk_norm=True, vocab_size=97, max_position_embeddings=64, **TINY)
    model, params = _random_model(config)
    models.save_pretrained(tmp_path / "path/to/Qwen3-0.6B", model, params)
    S, N, B = 6, 3, 2
    mask = np.ones((B, S), bool)
    mask[1, :2] = False
    tokens = np.where(mask, np.random.default_rng(0).integers(1, 97, (B, S)), 0)
    return dict(tokens=tokens, mask=mask, prompt=tokens, prompt_mask=mask, S=S, N=N, next_tokens=np.array([5, 6]))


def _model_check(namespace: dict, code: str):
    assert namespace["logits"].shape == (2, 6, 97) and namespace["next_logits"].shape == (2, 97)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(namespace["params"]))
    assert models.from_pretrained("path/to/out")[0].config.architecture == "qwen3"


def _policy() -> tuple:
    """The digit task and a tiny model for it."""
    task = DigitSumTask()
    config = models.ModelConfig(vocab_size=len(task.tokenizer), max_position_embeddings=32, **TINY)
    return task, *_random_model(config)


def _rollout(tmp_path) -> dict:
    task, model, params = _policy()
    prompts = task.prompts(np.random.default_rng(0), 3)
    return dict(
        model=model,
        params=params,
        prompt_tokens=prompts.tokens,
        prompt_mask=prompts.mask,
        key=jax.random.key(1),
        G=4,
        N=5,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
    )


def _rollout_check(namespace: dict, code: str):
    rollout, (P, S) = namespace["rollout"], namespace["prompt_tokens"].shape
    B, N = P * namespace["G"], namespace["N"]
    assert rollout.tokens.shape == (B, S + N)
    assert rollout.completion_mask.shape == rollout.logprobs.shape == (B, N)
    assert rollout.lengths.shape == rollout.truncated.shape == (B,)


def _train_check(namespace: dict, code: str):
    history = namespace["history"]
    assert len(history) == 10 and {"reward", "kl_k3", "update_seconds"} <= history[-1].keys()


def _mesh(tmp_path) -> dict:
    task, model, params = _policy()
    return dict(
        model=model,
        params=params,
        task=task,
        config=training.TrainConfig(num_prompts=4, group_size=2, sampling=SamplingConfig(max_new_tokens=2)),
    )


def _mesh_check(namespace: dict, code: str):
    assert len(namespace["history"]) == 1
    leaves = jax.tree.leaves(namespace["state"].params)
    assert all(len(leaf.sharding.device_set) == 8 for leaf in leaves)
    assert any(not leaf.sharding.is_fully_replicated for leaf in leaves)  # FSDP splits the matrices


def _tiny_model(task, *, max_positions: int) -> dict:
    """A one-layer model over ``task``'s tokenizer, with the task: what a training example is given."""
    config = models.ModelConfig(
        vocab_size=len(task.tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=max_positions,
    )
    model, params = models.init(config, jax.random.key(0))
    return dict(model=model, params=params, task=task)


def _environment(tmp_path) -> dict:
    from jaxrl_llm.tasks import CalculatorTask

    return _tiny_model(CalculatorTask(), max_positions=256)


def _environment_check(namespace: dict, code: str):
    (metrics,) = namespace["history"]
    assert {"reward_CounterEnv", "tools/call_frequency", "episodes/turns"} <= metrics.keys()


def _lora(tmp_path) -> dict:
    return _tiny_model(DigitSumTask(), max_positions=32)


def _lora_check(namespace: dict, code: str):
    assert len(namespace["history"]) == 2
    assert (pathlib.Path("my-adapter") / "adapter_config.json").is_file()
    assert namespace["merged_model"].config.lora is None
    assert len(namespace["more"]) == 1 and namespace["sft_model"].config.lora == models.LoraConfig(rank=8, alpha=16)
    base, _ = models.lora.split(namespace["policy"])  # the caller's arrays, not copies
    assert all(x is y for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(namespace["params"]), strict=True))


def _gguf(tmp_path) -> dict:
    """A tiny Q4_1 GGUF file, written as llama.cpp's converter writes one, at the example's path."""
    tokenizer = gguf_fixtures.bpe_tokenizer()
    path = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.parent.mkdir()
    hf_model = gguf_fixtures.tiny_gguf_hf_model("llama", tokenizer, num_hidden_layers=1)
    gguf_fixtures.write_gguf(path, hf_model, tokenizer, qtype="Q4_1")
    return {}


def _gguf_check(namespace: dict, code: str):
    written = pathlib.Path("out/policy.q8_0.gguf")
    assert {tensor.tensor_type.name for tensor in gguf.GGUFReader(written).tensors} == {"F32", "Q8_0"}
    assert models.load_tokenizer(written).get_vocab() == namespace["tokenizer"].get_vocab()


GIVEN: dict[tuple[str, str], tuple[Callable[[pathlib.Path], dict], Callable[[dict, str], None]]] = {
    ("docs/library.md", "core-grpo-update"): (_core, _core_check),
    ("docs/library.md", "model"): (_model, _model_check),
    ("docs/library.md", "gguf"): (_gguf, _gguf_check),
    ("docs/library.md", "rollout"): (_rollout, _rollout_check),
    ("docs/training.md", "train"): (lambda tmp_path: {}, _train_check),
    ("docs/scale-out.md", "mesh"): (_mesh, _mesh_check),
    ("docs/episodes.md", "environment"): (_environment, _environment_check),
    ("docs/lora.md", "lora-train"): (_lora, _lora_check),
}
"""Each Python example run here: what the test gives it, and what it checks after."""

SMALLER = {("docs/scale-out.md", "mesh"): {"steps=100": "steps=1"}}
"""Step counts an example states for a real run, made small for the test."""

SLOW = {("docs/training.md", "train"), ("docs/scale-out.md", "mesh")}

ELSEWHERE = {
    ("README.md", "own-data-cli/my_rewards.py"): "tests/test_readme.py",
    ("docs/data-and-rewards.md", "own-data"): "tests/test_readme.py",
}
"""Python examples run by a test of their own, with assertions of their own."""


def _python_examples() -> list:
    return [
        pytest.param(page, name, marks=[pytest.mark.slow] if (page, name) in SLOW else [], id=f"{page}:{name}")
        for page, name in GIVEN
    ]


@pytest.mark.parametrize("page, name", _python_examples())
def test_the_python_example_runs(page, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    given, check = GIVEN[page, name]
    code = example(page, name)
    for written, run in SMALLER.get((page, name), {}).items():
        assert code.count(written) == 1, f"{page}, {name!r}: {written!r} is not in the example once"
        code = code.replace(written, run)
    namespace = given(tmp_path)
    exec(compile(code, f"{page}, example {name!r}", "exec"), namespace)
    check(namespace, code)


def test_every_code_block_is_output_or_an_example_that_a_test_runs():
    for page in PAGES:
        names = [b.name for b in blocks(page) if b.name]
        assert len(names) == len(set(names)), f"{page}: example names repeat: {names}"
        for block in blocks(page):
            where = f"{page}:{block.line}"
            assert block.language in LANGUAGES, f"{where}: a block in {block.language!r}, not one of {LANGUAGES}"
            if block.language == "text":
                assert block.name is None, f"{where}: output is not an example"
                continue
            assert block.name, f"{where}: a {block.language} block without an <!-- example: NAME --> marker"
            if block.language == "python":
                assert ((page, block.name) in GIVEN) != ((page, block.name) in ELSEWHERE), (
                    f"{where}: the Python example {block.name!r} is run by no test (or by two)"
                )
    for page, name in [*GIVEN, *ELSEWHERE]:
        example(page, name)  # each exists, once


# --- TOML and bash ------------------------------------------------------------------------


def _examples(language: str) -> list:
    return [pytest.param(b, id=f"{b.page}:{b.name}") for page in PAGES for b in blocks(page) if b.language == language]


@pytest.mark.parametrize("block", _examples("toml"))
def test_the_toml_example_is_a_run_config(block):
    config = from_dict(tomllib.loads(block.code), where=f"{block.page}, {block.name}")
    assert isinstance(config, runs.RunConfig)


def _commands(code: str) -> list[str]:
    """The block's command lines: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


PLACEHOLDERS = {"X": "tiny", "$RANK": "0"}
"""Stand-ins in command lines for the reader's values: a config's name, a process's index."""


def _check_command(line: str, capsys):
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(line)]
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert words[1] in targets, f"{line}: no target {words[1]!r} in the Makefile"
        return
    if "experiments/compare_methods.py" in words:
        from experiments import compare_methods

        args = words[words.index("experiments/compare_methods.py") + 1 :]
        if args == ["--help"]:
            with pytest.raises(SystemExit) as exit_:
                compare_methods.parse(args)
            assert exit_.value.code == 0
        else:
            compare_methods.parse(args)
        return
    if "benchmarks/gpu_side_by_side.py" in words:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        try:
            import gpu_side_by_side
        finally:
            sys.path.remove(str(ROOT / "benchmarks"))
        gpu_side_by_side.parse(words[words.index("benchmarks/gpu_side_by_side.py") + 1 :])
        return
    if words[:4] == ["python3", "-m", "pip", "install"]:  # what `make gpu-wheels` downloaded, nothing else
        assert {"--no-index", "--no-deps", ".whl/*.whl"} <= set(words), f"{line}: not the offline wheels"
        assert "\nGPU_WHEELS := .whl\n" in (ROOT / "Makefile").read_text()
        return
    programs = [i for i, w in enumerate(words) if w.endswith("jaxrl-llm")]
    assert programs, f"{line}: names no command the docs test knows (make, jaxrl-llm, compare_methods.py)"
    command, *argv = words[programs[0] + 1 :]
    if command == "train":
        args, config = cli.parse_train(argv)
        assert isinstance(config, runs.RunConfig) and args.run_dir
    elif command in ("eval", "export"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0
        options = capsys.readouterr().out
        for flag in (w for w in argv if w.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", options), f"{line}: `jaxrl-llm {command}` has no {flag}"
    else:
        assert command in ("presets", "tasks") and not argv, f"{line}: an unknown command"
        assert cli.main([command]) == 0


@pytest.mark.parametrize("block", _examples("bash"))
def test_the_command_lines_parse(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative run directories are the test's own
    if block.page == "README.md":  # the own-data commands read the files beside them
        (tmp_path / "my_rewards.py").write_text(example("README.md", "own-data-cli/my_rewards.py"))
        (tmp_path / "run.toml").write_text(example("README.md", "own-data-cli/run.toml", "toml"))
    commands = _commands(block.code)
    assert commands
    for line in commands:
        if line.endswith('"'):  # a command run remotely: gcloud's --command="..."
            line = line.split('--command="', 1)[1].rstrip('"').split("&& ", 1)[-1]
        _check_command(line, capsys)


def test_make_run_is_the_command_the_readme_names():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nrun:", 1)[1].split("\n\n", 1)[0]
    named = re.search(r"`make run` is `([^`]+)`", (ROOT / "README.md").read_text()).group(1)
    assert f"$(BIN)/{named} $(RUN_FLAGS)" in recipe
    assert "\nmake test\n" in (ROOT / ".ci/run").read_text()  # CI runs the README's test command


# --- The README's table of TRL's names -----------------------------------------------------


def test_every_name_of_ours_in_the_trl_table_exists():
    text = (ROOT / "README.md").read_text()
    table = text.split("## From TRL's `GRPOConfig`", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) > 30
    fields = {
        "train": training.TrainConfig,
        "algorithm": algorithms.Algorithm,
        "task": runs.TaskSpec,
        "model": runs.ModelSpec,
    }
    names = {f.name for f in dataclasses.fields(runs.RunConfig)}
    flags = {option for action in cli._train_parser()._actions for option in action.option_strings}
    checked = 0
    for row in rows:
        for token in re.findall(r"`([^`]+)`", row[1]):
            prefix = re.match(r"(train|algorithm|task|model)\.([\w.]+)", token)
            if prefix:
                kind = fields[prefix.group(1)]
                for name in prefix.group(2).split("."):  # train.sampling.temperature: a group's field
                    assert dataclasses.is_dataclass(kind), token
                    field = {f.name: f for f in dataclasses.fields(kind)}.get(name)
                    assert field is not None, token
                    kind = type(field.default)
            elif re.fullmatch(r"[a-z_]+", token):
                assert token in names, f"{token!r} is not a field of RunConfig"
            elif token.startswith("--"):
                assert token in flags, f"{token!r} is not a flag of jaxrl-llm train"
            else:
                continue
            checked += 1
    assert checked > 50


# --- Links ---------------------------------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_the_relative_links_resolve(page):
    text = (ROOT / page).read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ((ROOT / page).parent / path).resolve() if path else ROOT / page
        assert file.exists(), f"{page}: a link to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page}: a link to {target}, a heading not there"
