"""A :class:`~jaxrl_llm.runs.config.RunConfig`'s objects: tokenizer, model, task, reward
functions, the warm start and the abstract train state a checkpoint restores into."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pathlib
import site
import sys
import sysconfig
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import transformers

import jaxrl_llm
from jaxrl_llm import episodes, models, rewards, sharding, tasks, training
from jaxrl_llm.episodes import scoring
from jaxrl_llm.runs.config import (
    BUILTIN_ALPHABET,
    BUILTIN_CHAT_TEMPLATE,
    DEFAULT_MODEL,
    DEMO_TASKS,
    ModelSpec,
    RunConfig,
    TaskSpec,
)

REWARDS: dict[str, Callable[..., Any]] = {
    "exact_match": rewards.exact_match,
    "math_equivalence": rewards.math_equivalence,
    "format_reward": rewards.format_reward,
    "code_execution": rewards.code_execution,
    "length_penalty": rewards.length_penalty,
}
"""The built-in reward functions a config names (``task.rewards``); see :mod:`jaxrl_llm.rewards`."""

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_model_path(spec: ModelSpec) -> None:
    """Raises FileNotFoundError (or ValueError, for a directory of several GGUF files), before
    any compute, if ``spec.path`` is neither a model directory nor a GGUF file."""
    if spec.path is None:
        return
    try:
        gguf_file = models.gguf.find_file(spec.path)
    except (FileNotFoundError, ValueError) as error:
        default = pathlib.Path(spec.path).name == pathlib.Path(DEFAULT_MODEL).name
        fetch = default and isinstance(error, FileNotFoundError)
        hint = f" `make model`, in the repository's root, puts it at {DEFAULT_MODEL}." if fetch else ""
        raise type(error)(f"model.path: {error}{hint}") from None
    if gguf_file is not None:
        return
    if not os.path.isdir(spec.path):
        raise FileNotFoundError(
            f"model.path {spec.path!r} is neither a GGUF file nor a directory (a Hugging Face model directory "
            "with config.json, safetensors weights and a tokenizer)."
        )
    if not os.path.isfile(os.path.join(spec.path, "config.json")):
        raise FileNotFoundError(
            f"model.path {spec.path!r} has no config.json and no .gguf file: not a Hugging Face model directory."
        )


def check_positions(config: RunConfig) -> None:
    """Raises ValueError, before any compute, if ``train.sampling.max_new_tokens`` leave no room for
    a prompt in a checkpoint's ``max_position_embeddings`` (the sampler checks each batch's
    prompt width; the built-in model's limit is checked by the config)."""
    if config.model.path is None:
        return
    check_model_path(config.model)
    limit = models.read_config(config.model.path).max_position_embeddings
    budget = config.train.sampling.max_new_tokens
    if budget >= limit:
        raise ValueError(
            f"train.sampling.max_new_tokens ({budget}) leaves no room for a prompt in the model in "
            f"{config.model.path!r} (max_position_embeddings = {limit}); lower it."
        )


def tokenizer(spec: ModelSpec, *, tool_calling: bool = False) -> transformers.PreTrainedTokenizerBase:
    """The model directory's or GGUF file's tokenizer, or the built-in character tokenizer with
    its chat template: with ``tool_calling`` (a task with tools or an environment), the
    character tokenizer's tool-calling one (:func:`jaxrl_llm.tasks.build_chat_tokenizer`)."""
    if spec.path is None:
        if tool_calling:
            return tasks.build_chat_tokenizer(BUILTIN_ALPHABET)
        built = tasks.build_char_tokenizer(BUILTIN_ALPHABET)
        built.chat_template = BUILTIN_CHAT_TEMPLATE
        return built
    check_model_path(spec)
    return models.load_tokenizer(spec.path)


def model_config(spec: ModelSpec, task: tasks.Task, max_positions: int) -> models.ModelConfig:
    """The built-in decoder's configuration for ``task``'s tokenizer and stop ids."""
    tokenizer_ = task.tokenizer
    return models.ModelConfig(
        vocab_size=len(tokenizer_),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer_.bos_token_id,
        eos_token_ids=tuple(task.eos_ids),
        pad_token_id=task.pad_id,
        param_dtype=_DTYPES[spec.param_dtype],
        dtype=_DTYPES[spec.dtype or spec.param_dtype],
    )


def model(
    config: RunConfig, task: tasks.Task, *, abstract: bool = False, mesh=None
) -> tuple[models.Model, models.Params]:
    """The policy before training: the model directory's weights, or the built-in decoder
    initialised from ``config.train.seed``, in the spec's layers layout (``scan_layers``), with
    its execution options (remat, attention), int8 with ``model.quantization``. ``abstract``: shapes and dtypes
    only (``jax.ShapeDtypeStruct`` leaves), nothing read or computed. ``mesh``: a model directory's tensors are read
    straight into their shards by ``config.mesh.rules``."""
    spec = config.model
    options = dict(remat=spec.remat, attention=spec.attention)
    layout = dict(quantization=spec.quantization, scan_layers=spec.scan_layers)
    if spec.path is None:
        sampling = config.train.sampling
        positions = sampling.max_prompt_length + sampling.max_new_tokens
        if config.task.tools or config.task.environment or getattr(task, "tools", ()):
            positions = episodes.sampling.max_cache_slots(
                max_prompt_length=sampling.max_prompt_length, max_new_tokens=sampling.max_new_tokens
            )  # an episode's cache has room for gaps between turns
        built = dataclasses.replace(model_config(spec, task, positions), **layout)
        if abstract:
            model_, params = models.abstract(built)
        else:
            key = jax.random.key(config.train.seed)
            model_, params = models.init(built, key, compilation_cache=config.compilation_cache)
    else:
        check_model_path(spec)
        dtype, compute = _DTYPES[spec.param_dtype], _DTYPES[spec.dtype or spec.param_dtype]
        if abstract:
            built = models.read_config(spec.path, dtype=dtype, compute_dtype=compute)
            model_, params = models.abstract(dataclasses.replace(built, **layout))
        else:
            model_, params = models.from_pretrained(
                spec.path,
                dtype,
                compute_dtype=compute,
                mesh=mesh,
                rules=None if mesh is None else sharding.RULES[config.mesh.rules],
                **layout,
            )
    return models.with_options(model_, **options), params


@functools.cache
def _library_directories() -> tuple[str, ...]:
    """Where code that is not the user's lives: this library, the standard library and the
    installed packages (the environment's, the user's and the system's site directories)."""
    paths = sysconfig.get_paths()
    found = {
        str(pathlib.Path(jaxrl_llm.__file__).resolve().parent),
        *(paths[name] for name in ("stdlib", "purelib", "platlib")),
        *site.getsitepackages(),
        site.getusersitepackages(),
    }
    return tuple(os.path.realpath(path) + os.sep for path in found)


def is_library_file(filename: str | os.PathLike) -> bool:
    """Whether ``filename`` is this library's, the standard library's or an installed
    package's, not the user's own code."""
    path = os.path.realpath(filename)
    return path.startswith(_library_directories()) or any(
        part in ("site-packages", "dist-packages") for part in pathlib.Path(path).parts
    )


def _import_file(path: pathlib.Path):
    """The module of a ``.py`` file, imported as ``python -m`` would from its directory: the
    first directory up without an ``__init__.py`` is searched first while importing, and
    stays on ``sys.path`` after the others (so the module imports its siblings, also later,
    and a package's relative imports work). A module of the same name imported before from
    another user file (another project's ``my_rewards``) is replaced; one installed or in
    the standard library is an error (rename the file)."""
    root, parts = path.parent, [] if path.name == "__init__.py" else [path.stem]
    while (root / "__init__.py").is_file():
        root, parts = root.parent, [root.name, *parts]
    name = ".".join(parts)
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) and pathlib.Path(loaded.__file__).resolve() == path:
        return loaded
    for key in [key for key in sys.modules if key == parts[0] or key.startswith(f"{parts[0]}.")]:
        file = getattr(sys.modules[key], "__file__", None)
        if file is None or is_library_file(file):
            raise ImportError(
                f"a module named {parts[0]!r} is already imported from {file or 'the interpreter'}; rename {path.name}",
                name=name,
            )
        del sys.modules[key]  # the same name from another user file
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
        sys.path.append(str(root))


def reward_function(name: str) -> Callable[..., Any]:
    """A built-in reward function by name, or a ``module:function`` / ``path/to/file.py:function``
    (:func:`imported`).

    Raises ValueError naming the entry: unknown, not found (saying where it looked), an
    error while importing the module (the original is its ``__cause__``), or no such
    callable in it."""
    if name in REWARDS:
        return REWARDS[name]
    if not name.rpartition(":")[1]:
        raise ValueError(
            f"task.rewards: unknown reward {name!r}; the built-in ones are {', '.join(REWARDS)}, "
            "or give `module:function` or `path/to/file.py:function`."
        )
    return imported(name, where="task.rewards")


def tools(spec: TaskSpec) -> list[Callable[..., Any]]:
    """The task's ``tools`` entries, imported (:func:`imported`)."""
    return [imported(name, where="task.tools") for name in spec.tools]


def environment_factory(spec: TaskSpec) -> Callable[[], Any] | dict[str, Callable[[], Any]] | None:
    """The task's ``environment`` factory, or its factories by name, imported
    (:func:`imported`); ``None`` without one."""
    if isinstance(spec.environment, dict):
        return {name: imported(entry, where=f"task.environment.{name}") for name, entry in spec.environment.items()}
    return None if spec.environment is None else imported(spec.environment, where="task.environment")


def imported(name: str, *, where: str) -> Callable[..., Any]:
    """The callable ``module:attribute`` imported (from ``sys.path``;
    :func:`~jaxrl_llm.runs.config.code_source` first turns a module in the current directory
    or beside the config file into its path), or ``path/to/file.py:attribute``.

    Raises ValueError naming ``where`` and the entry: not found (saying where it looked), an
    error while importing the module (the original is its ``__cause__``), or no such
    callable in it."""
    module_name, _, attribute = name.rpartition(":")
    is_file = module_name.endswith(".py")
    path = pathlib.Path(module_name).expanduser().resolve() if is_file else None
    if is_file and not path.is_file():
        raise ValueError(f"{where}: cannot import {name!r}: there is no file {module_name!r}.")
    try:
        module = _import_file(path) if is_file else importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if is_file or not error.name or not (module_name + ".").startswith(error.name + "."):
            raise ValueError(f"{where}: importing {name!r} failed: {type(error).__name__}: {error}.") from error
        raise ValueError(
            f"{where}: cannot import {name!r}: {error} (looked for "
            f"{module_name.replace('.', '/')}.py in the current directory {os.getcwd()}, beside the "
            f"config file, and among the installed modules; or write the file's path, "
            f"'path/to/{module_name.split('.')[-1]}.py:{attribute}')."
        ) from None
    except Exception as error:  # noqa: BLE001 (the user's module failed: shown with its frames)
        raise ValueError(f"{where}: importing {name!r} failed: {type(error).__name__}: {error}") from error
    found = getattr(module, attribute, None)
    if found is None:
        raise ValueError(f"{where}: {name!r}: {module.__name__} has no {attribute!r}.")
    if not callable(found):
        raise ValueError(f"{where}: {name!r} is not callable.")
    return found


def run_task(config: RunConfig) -> tasks.Task:
    """The task of a run: its :class:`TaskSpec` over the model's tokenizer (the tool-calling
    one for a task with tools or an environment)."""
    tool_calling = bool(config.task.tools or config.task.environment)
    return task(config.task, tokenizer(config.model, tool_calling=tool_calling), checkpoint=config.model.path)


def task(
    spec: TaskSpec, tokenizer_: transformers.PreTrainedTokenizerBase, *, checkpoint: str | None = None
) -> tasks.Task:
    """The task a :class:`TaskSpec` names, over ``tokenizer_`` (stop ids also from
    ``checkpoint``: a model directory's ``generation_config.json``, a GGUF file's EOS and
    end-of-turn ids)."""
    reward_fns = [reward_function(name) for name in spec.rewards] or None
    common: dict[str, Any] = dict(tokenizer=tokenizer_)
    if spec.reward_weights is not None:
        common["reward_weights"] = spec.reward_weights
    stops: dict[str, Any] = dict(checkpoint=checkpoint)
    if checkpoint is not None and models.gguf.find_file(checkpoint) is not None:
        ids = [tokenizer_.eos_token_id, *models.read_config(checkpoint).eos_token_ids]
        stops = dict(eos_ids=tuple(dict.fromkeys(i for i in ids if i is not None)))
    text: dict[str, Any] = dict(common, system_prompt=spec.system_prompt, stop_strings=spec.stop_strings, **stops)
    if spec.name == "environment":  # the environment owns the data and scores with get_reward (or the rewards)
        return dataclasses.replace(tasks.environment_task(tokenizer_, **stops), reward_fns=reward_fns or ())
    if spec.name == "calculator":
        if reward_fns is not None:
            raise ValueError(
                "task 'calculator' scores with its own rewards (correct, calls); leave task.rewards empty."
            )
        return tasks.CalculatorTask()
    if spec.name == "digits":
        return tasks.DigitSumTask() if reward_fns is None else tasks.DigitSumTask(reward_fns=reward_fns)
    if spec.name == "arithmetic":
        return tasks.arithmetic(
            num_operands=spec.num_operands,
            digits=spec.digits,
            operators=spec.operators,
            test_size=spec.test_size,
            prompt_format=spec.prompt_format,
            reward_fns=reward_fns,
            **text,
        )
    if spec.name == "reasoning_gym":
        return tasks.reasoning_gym(
            spec.dataset,
            size=spec.size,
            seed=spec.seed,
            test_size=100 if spec.test_size is None else spec.test_size,
            reward_fns=reward_fns,
            **text,
        )
    reward_fns = reward_fns or ([] if spec.environment is not None else [rewards.exact_match])  # TRL: get_reward alone
    source = dict(
        prompt=spec.prompt, test_fraction=spec.test_fraction, split_seed=spec.seed, reward_fns=reward_fns, **text
    )
    if spec.name == "jsonl":
        return tasks.from_jsonl(spec.path, test_path=spec.test_path, **source)
    return tasks.from_dataset(spec.path, test_dataset=spec.test_path, **source)


def _demonstration_count(config: RunConfig, task_: tasks.Task) -> int:
    """The warm start's example count; raises ValueError if the task cannot give them."""
    if not isinstance(task_, (tasks.TextTask, tasks.CalculatorTask)):
        raise ValueError(
            f"warm_start.steps: the {type(task_).__name__} has no text demonstrations; set "
            "warm_start.steps = 0 and warm_start.anneal_steps = 0."
        )
    wanted, available = config.warm_start.examples, task_.split_size("train")
    if wanted is None and available is None:
        raise ValueError(
            "warm_start.examples: the task's train split is procedural (no end); set how many "
            "examples the demonstrations come from."
        )
    if wanted is not None and available is not None and wanted > available:
        raise ValueError(
            f"warm_start.examples={wanted} is more than the task's {available} train examples; "
            f"set at most {available}, or leave it unset for all of them."
        )
    return available if wanted is None else wanted


def demonstrations(
    config: RunConfig, task_: tasks.Task, *, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The warm start's solved examples: ``examples`` train prompts (default: all; at most
    ``limit``) with their ``completion`` column, ``off_by_one_fraction`` of the integer
    answers replaced by ``answer + 1``; for the calculator task, its demonstration
    episodes (the assistant's turns learned, the tool results read). Raises ValueError for
    more examples than the train split holds, a missing column, or a non-integer answer to
    shift."""
    warm = config.warm_start
    if isinstance(task_, tasks.CalculatorTask):
        count = _demonstration_count(config, task_)
        conversations = task_.demonstrations(count if limit is None else min(count, limit), seed=config.train.seed)
        return tasks.calculator.sft_arrays(task_.tokenizer, conversations, tools=task_.tools)
    if config.task.tools or config.task.environment:
        return _episode_demonstrations(config, task_, limit=limit)
    rng = np.random.default_rng(config.train.seed)

    def target(record) -> str:
        if warm.completion not in record:
            raise ValueError(
                f"warm_start.completion: the task's examples have no column {warm.completion!r}; "
                f"they have {', '.join(record)}."
            )
        answer = str(record[warm.completion])
        if warm.off_by_one_fraction and rng.random() < warm.off_by_one_fraction:
            try:
                return str(int(answer) + 1)
            except ValueError:
                raise ValueError(f"warm_start.off_by_one_fraction needs integer answers; got {answer!r}.") from None
        return answer

    count = _demonstration_count(config, task_)
    return task_.demonstrations(
        "train",
        np.arange(count if limit is None else min(count, limit)),
        completion=target,
        max_new_tokens=config.train.sampling.max_new_tokens,
        seed=config.train.seed,
    )


def _episode_demonstrations(
    config: RunConfig, task_: tasks.Task, *, limit: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The warm start of a task with tools or an environment: each train prompt (a
    conversation) followed by its ``completion`` column, a final answer (a string) or a
    demonstration episode (a list of messages: the assistant's with their ``tool_calls``,
    the tools' results, the final answer), rendered as the rollouts render them, with the
    tools' schemas (an environment's methods among them); the assistant's tokens learned."""
    warm = config.warm_start
    if isinstance(config.task.environment, dict):
        raise ValueError(
            "warm_start: a table of environments offers each example other tools, which the demonstrations do not "
            "follow yet; warm-start with one environment, or without (warm_start.steps = 0)."
        )
    toolset = scoring.Toolset.build(
        task_, tools=tools(config.task), environment_factory=environment_factory(config.task)
    )
    row_tools = toolset.tools if toolset.environments is None else toolset.environments.tools_for(None)
    count = _demonstration_count(config, task_)
    batch = task_.examples("train", np.arange(count if limit is None else min(count, limit)), seed=config.train.seed)
    if warm.completion not in batch.columns:
        raise ValueError(
            f"warm_start.completion: the task's examples have no column {warm.completion!r}; they have "
            f"{', '.join(batch.columns)}."
        )
    conversations = []
    for index, (prompt, completion) in enumerate(zip(batch.prompts, batch.columns[warm.completion], strict=True)):
        if isinstance(prompt, str):
            raise ValueError(f"warm_start: example {index}'s prompt is text; a task with tools needs conversations.")
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        elif not (isinstance(completion, list) and completion and all(isinstance(m, dict) for m in completion)):
            raise ValueError(
                f"warm_start.completion: example {index}'s {warm.completion!r} must be the answer (a string) or a "
                f"demonstration episode (a list of messages: the assistant's, with their tool_calls, and the "
                f"tools'); got {completion!r:.120}."
            )
        conversations.append([*prompt, *completion])
    return tasks.calculator.sft_arrays(task_.tokenizer, conversations, tools=row_tools, pad_id=task_.pad_id)


def check_demonstrations(config: RunConfig, task_: tasks.Task) -> None:
    """Raises ValueError, before any compute, if :func:`demonstrations` would (the count,
    and the first example's column and answer), or if labels are to be made wrong on
    purpose (``off_by_one_fraction``) outside the demo's task (:data:`DEMO_TASKS`)."""
    warm = config.warm_start
    if warm.off_by_one_fraction and config.task.name not in DEMO_TASKS:
        raise ValueError(
            f"warm_start.off_by_one_fraction={warm.off_by_one_fraction} makes that fraction of the warm "
            f"start's labels wrong on purpose, for the demo on the {' and '.join(DEMO_TASKS)} task; on "
            f"task {config.task.name!r} set warm_start.off_by_one_fraction = 0 (the labels as they are)."
        )
    demonstrations(config, task_, limit=1)


def warm_start(
    config: RunConfig, model_: models.Model, params: models.Params, task_: tasks.Task
) -> tuple[models.Params, list[float]]:
    """``params`` fine-tuned on :func:`demonstrations`: ``steps`` at ``learning_rate``, then
    ``anneal_steps`` at ``anneal_learning_rate``; and the losses."""
    warm = config.warm_start
    if not warm.enabled:
        return params, []
    examples = demonstrations(config, task_)
    losses: list[float] = []
    for steps, learning_rate, seed in (
        (warm.steps, warm.learning_rate, config.train.seed),
        (warm.anneal_steps, warm.anneal_learning_rate, config.train.seed + 1),
    ):
        if steps:
            params, more = training.supervised_finetune(
                model_,
                params,
                *examples,
                steps=steps,
                batch_size=warm.batch_size,
                learning_rate=learning_rate,
                seed=seed,
            )
            losses += more
    return params, losses


def check_memory(config: RunConfig, task_: tasks.Task) -> None:
    """Raises ValueError, before anything is allocated, when the train state cannot fit this
    machine's memory: the model's parameters, once for a LoRA base (adapters aside), else four
    times (the parameters, their gradients, Adam's two moments), once more for a reference.
    One process without a mesh only (a sharded state is spread over devices and hosts)."""
    if jax.process_count() > 1 or config.mesh.build() is not None:
        return
    spec = config.model
    built = model_config(spec, task_, 1) if spec.path is None else models.read_config(spec.path)  # rotary: no table
    _, params = models.abstract(built)
    size = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    copies = 1 if config.lora.build() is not None else 4 + training.state.uses_reference(config.algorithm, config.train)
    needed, available = copies * size, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > available:
        count = sum(leaf.size for leaf in jax.tree.leaves(params))
        raise ValueError(
            f"the train state needs about {needed / 2**30:,.1f} GiB ({count:,} parameters x {copies} copies: "
            f"parameters, gradients, Adam's moments{', the reference' if copies == 5 else ''}), more than this "
            f"machine's {available / 2**30:,.1f} GiB of memory. Make the model smaller (model.hidden_size, "
            f"num_layers), or train LoRA adapters ([lora] rank)."
        )
