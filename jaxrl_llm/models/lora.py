r"""LoRA: low-rank adapters over a frozen base, the adapters a params pytree of their own.

.. code-block:: python

    model, base = models.from_pretrained("path/to/checkpoint", dtype=jnp.bfloat16)
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=16), key)
    params = lora.combine(base, adapters)  # the adapted policy's params: base and adapters
    logits = models.forward(lora_model, params, tokens)  # the base's exactly, at initialisation
    reference = models.forward(model, base, tokens)  # the adapters off: the base itself, no copy
    merged_model, merged = lora.merge(lora_model, params)  # W + s A B: a plain model, for decoding

A targeted projection :math:`W` (``[in, out]``, its axes as the kernel stores them) gains
:math:`A` (``[in, r]``) and :math:`B` (``[r, out]``) and computes

.. math::
    y = x W + s\,(x A) B, \qquad s = \alpha / r \quad (\text{rsLoRA: } \alpha / \sqrt{r})

unmerged: the base's weights are read as they are, and only :math:`A` and :math:`B` are
differentiated when the loss is taken with respect to the adapters
(:class:`~jaxrl_llm.models.config.LoraConfig`). The adapters are the model's
:class:`~jaxrl_llm.models.decoder.LoraParam` leaves, named ``{target}_lora_a`` and
``{target}_lora_b`` beside the kernel they adapt; :func:`split` and :func:`combine` take a
LoRA model's params apart into the base's (the params of the model without adapters, the
same tree as ``model``'s) and the adapters, and put them back together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_llm.models.config import LoraConfig, ModelConfig
from jaxrl_llm.models.decoder import CausalLM, LoraParam, is_stacked, lora_a_init, stack_layers, unstack_layers
from jaxrl_llm.models.functional import Model, Params, abstract
from jaxrl_llm.models.quantize import dequantize
from jaxrl_llm.models.staging import staged_directory

__all__ = [
    "LoraConfig",
    "LoraParam",
    "abstract_adapters",
    "adapted",
    "add_adapters",
    "base_model",
    "combine",
    "init_adapters",
    "load_adapter",
    "merge",
    "read_adapter_config",
    "save_adapter",
    "split",
]


def _adapted(config: ModelConfig, lora: LoraConfig) -> ModelConfig:
    if not isinstance(lora, LoraConfig):
        raise TypeError(f"lora: expected a LoraConfig; got {type(lora).__name__}.")
    if config.lora is not None:
        raise ValueError(
            f"lora: the model already has adapters ({config.lora}); merge them first (lora.merge) or start from "
            "its base (lora.base_model, lora.split)."
        )
    return dataclasses.replace(config, lora=lora)


def _adapter_shapes(config: ModelConfig) -> dict[tuple, LoraParam]:
    """Path -> abstract :class:`LoraParam` of every adapter of a model with ``config``
    (nothing allocated)."""
    module = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(params=0)))
    return dict(nnx.to_flat_state(nnx.state(module, LoraParam)))


def init_adapters(config: ModelConfig, key: jax.Array) -> Params:
    """The adapters of a model with ``config`` (``config.lora`` set), initialised as PEFT
    does by default (every ``A`` by :func:`~jaxrl_llm.models.decoder.lora_a_init`, every
    ``B`` zero). Only the adapters are allocated."""
    if config.lora is None:
        raise ValueError("init_adapters: the config has no `lora` (a LoraConfig) to initialise adapters for.")
    # Drawn per layer in both layouts (a key per per-layer adapter), then stacked: the same
    # adapters whatever config.scan_layers.
    specs = _adapter_shapes(dataclasses.replace(config, scan_layers=False))
    keys = dict(zip(specs, jax.random.split(key, len(specs)), strict=True))

    def initial(path, shape):
        if path[-1].endswith("_lora_b"):
            return jnp.zeros(shape.shape, shape.dtype)
        return lora_a_init(keys[path], shape.shape, shape.dtype)

    adapters = nnx.from_flat_state({path: v.replace(initial(path, v.get_value())) for path, v in specs.items()})
    return stack_layers(adapters) if config.scan_layers else adapters


def abstract_adapters(model: Model) -> Params:
    """The adapters of the LoRA ``model`` as shapes and dtypes (``jax.ShapeDtypeStruct``
    leaves): what a checkpoint restores into, or a state is checked against."""
    return jax.eval_shape(lambda: init_adapters(model.config, jax.random.key(0)))


def add_adapters(model: Model, config: LoraConfig, key: jax.Array) -> tuple[Model, Params]:
    """``model`` with adapters on ``config.targets``: the LoRA model and its initialised
    adapters (:func:`init_adapters`). Its params are ``combine(base, adapters)``, with
    ``base`` ``model``'s params, unchanged and not copied.

    Raises:
      ValueError: ``model`` has adapters already.
    """
    lora_model = adapted(model, config)
    return lora_model, init_adapters(lora_model.config, key)


def adapted(model: Model, config: LoraConfig) -> Model:
    """``model`` with adapters on ``config.targets``, nothing allocated: the LoRA model whose
    params are ``combine(base, adapters)`` (for adapters restored from a checkpoint or
    :func:`load_adapter`; :func:`add_adapters` also initialises them).

    Raises:
      ValueError: ``model`` has adapters already.
    """
    return abstract(_adapted(model.config, config))[0]


def base_model(model: Model) -> Model:
    """The model without its adapters (``model`` itself if it has none): the model the
    base params of :func:`split` belong to."""
    if model.config.lora is None:
        return model
    return abstract(dataclasses.replace(model.config, lora=None))[0]


def split(params: Params) -> tuple[Params, Params]:
    """A LoRA model's params -> ``(base, adapters)``: the base's params (the tree of the model
    without adapters) and the :class:`LoraParam` leaves."""
    adapters, base = nnx.split_state(params, LoraParam, ...)
    return base, adapters


def combine(base: Params, adapters: Params) -> Params:
    """The params of the LoRA model from its base's params and its adapters (:func:`split`'s
    inverse). The leaves are the given arrays, not copies."""
    return nnx.merge_state(base, adapters)


def merge(model: Model, params: Params, *, dtype=None) -> tuple[Model, Params]:
    r"""The adapters folded into the base: every targeted kernel becomes
    :math:`W + s\,A B` (computed in float32, stored in ``dtype``, by default the kernel's;
    an int8 base's :math:`W` is its dequantized :math:`s \odot Q` in ``param_dtype``),
    the other leaves are the base's own arrays. Returns the model without adapters
    (:func:`base_model`) and its params: the same function up to float rounding, at the
    cost of a copy of the targeted kernels.

    Raises:
      ValueError: ``model`` has no adapters.
    """
    lora = model.config.lora
    if lora is None:
        raise ValueError("merge: the model has no adapters (its config's `lora` is None).")
    model, params = dequantize(model, params)  # an int8 base: s Q in param_dtype first
    base, adapters = split(params)
    flat = dict(nnx.to_flat_state(adapters))

    def merged(path, leaf):
        a = flat.get((*path[:-1], f"{path[-1]}_lora_a"))
        if a is None:
            return leaf
        b = flat[(*path[:-1], f"{path[-1]}_lora_b")][...]
        kernel = leaf[...]
        stack = kernel.shape[:1] if is_stacked(path) else ()  # [L] of a stacked layout
        a, b = a[...].astype(jnp.float32), b.astype(jnp.float32)
        delta = a.reshape(*stack, -1, lora.rank) @ b.reshape(*stack, lora.rank, -1)  # [(L,) in, out]
        value = kernel.astype(jnp.float32) + lora.scale * delta.reshape(kernel.shape)
        return leaf.replace(value.astype(dtype or kernel.dtype))

    merged_params = nnx.from_flat_state({path: merged(path, leaf) for path, leaf in nnx.to_flat_state(base)})
    return base_model(model), merged_params


# --- PEFT's adapter format --------------------------------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def peft_name(path: tuple) -> str:
    """An adapter's path (``("layers", i, "self_attn", "q_proj_lora_a")``) -> its tensor name
    in a PEFT checkpoint (``base_model.model.model.layers.i.self_attn.q_proj.lora_A.weight``)."""
    match path:
        case ("layers", layer, module, name) if name.endswith(("_lora_a", "_lora_b")):
            target, which = name[: -len("_lora_a")], name[-1].upper()
            if _MODULES.get(target) == module:
                return f"base_model.model.model.layers.{layer}.{module}.{target}.lora_{which}.weight"
    raise KeyError(f"No PEFT name for adapter {'/'.join(map(str, path))}.")


def peft_tensors(adapters: Params) -> dict[str, np.ndarray]:
    """The adapters as PEFT stores them: ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
    ``[out, r]`` (torch ``Linear`` layouts, the in and out features flattened as the Hugging
    Face kernels flatten them)."""
    tensors = {}
    for path, leaf in nnx.to_flat_state(unstack_layers(adapters)):
        value = np.asarray(jax.device_get(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf))
        flat = value.reshape(-1, value.shape[-1]) if path[-1].endswith("_lora_a") else value.reshape(value.shape[0], -1)
        tensors[peft_name(path)] = np.ascontiguousarray(flat.T)
    return tensors


def save_adapter(
    path: str | os.PathLike, model: Model, params: Params, *, base_model_name_or_path: str | None = None
) -> None:
    """Writes the adapters of ``model`` (a LoRA model; ``params`` its params, or its adapters
    alone) as a PEFT adapter directory: ``adapter_config.json`` and
    ``adapter_model.safetensors`` with PEFT's tensor names, which
    ``peft.PeftModel.from_pretrained(base, path)`` loads. The directory is written aside and
    swapped in whole (as :func:`jaxrl_llm.models.save_pretrained` does): never half-written.

    Raises:
      ValueError: ``model`` has no adapters.
    """
    lora = model.config.lora
    if lora is None:
        raise ValueError("save_adapter: the model has no adapters (its config's `lora` is None); save_pretrained.")
    adapters = split(params)[1]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "use_rslora": lora.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
    }
    target = pathlib.Path(path).resolve()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"Cannot save an adapter to {target}: it is a file, not a directory.")
    previous = {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "adapter_model.bin"}  # a previous adapter's files (PEFT's too)
    with staged_directory(target, replaced=lambda: previous) as staging:
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(peft_tensors(adapters), staging / ADAPTER_WEIGHTS, metadata={"format": "pt"})


_PEFT_METADATA = frozenset(
    {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
     "megatron_core", "qalora_group_size"}
)  # fmt: skip
"""Keys of a PEFT LoRA config that do not change what the adapter computes."""
_PEFT_PLAIN = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "exclude_modules": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "megatron_config": None,
    "trainable_token_indices": None,
    "loftq_config": {},
    "eva_config": None,
    "corda_config": None,
    "lora_ga_config": None,
    "velora_config": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "monteclora_config": None,
    "layer_replication": None,
    "target_parameters": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "ensure_weight_tying": False,
}
"""Keys of a PEFT LoRA config with the value plain LoRA has: another value is a variant
this library does not compute (DoRA, biases, other modules, per-layer ranks, aLoRA,
QALoRA, ...) and is refused."""
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
"""``init_lora_weights`` values whose adapters pair with a base PEFT changed at
initialisation (unless converted to plain LoRA on saving)."""


def _lora_config_from_peft(config: dict, where: pathlib.Path, dtype) -> LoraConfig:
    """A :class:`LoraConfig` from a PEFT ``adapter_config.json``: what it cannot represent,
    keys it does not know with a value set, and values of the wrong type are refused by name."""

    def refuse(what: str) -> ValueError:
        return ValueError(f"load_adapter: {where / ADAPTER_CONFIG}: {what}")

    if not isinstance(config, dict):
        raise refuse(f"expected a JSON object; got a JSON {type(config).__name__}.")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not supported; only 'LORA'.")
    for key, plain in _PEFT_PLAIN.items():
        value = config.get(key, plain)
        if value != plain and not (value in (None, [], {}) and plain in (None, [], {})):
            raise refuse(f"{key}={value!r:.80} is not supported: only plain LoRA ({key}={plain!r}).")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise refuse(
            f"init_lora_weights={init!r} pairs the adapter with a base PEFT changed at initialisation; save it "
            f"converted to plain LoRA (PEFT's path_initial_model_for_weight_conversion)."
        )
    known = {*_PEFT_METADATA, *_PEFT_PLAIN, "peft_type", "init_lora_weights", "r", "lora_alpha", "lora_dropout",
             "use_rslora", "target_modules"}  # fmt: skip
    if unknown := sorted(key for key in config if key not in known and config[key] not in (None, False, [], {}, "")):
        raise refuse(f"unknown key(s) {unknown} set: a LoRA variant this library does not know; refused.")

    def typed(key: str, types: tuple, default, check=lambda value: True, expected: str = ""):
        value = config.get(key, default)
        if isinstance(value, bool) and bool not in types or not isinstance(value, types) or not check(value):
            raise refuse(f"{key} must be {expected}; got {value!r:.80}.")
        return value

    rank = typed("r", (int,), None, lambda v: v > 0, "an integer > 0")
    alpha = typed("lora_alpha", (int, float), 8, math.isfinite, "a finite number")
    dropout = typed("lora_dropout", (int, float), 0.0, lambda v: 0 <= v < 1, "a number in [0, 1)")
    rslora = typed("use_rslora", (bool,), False, expected="true or false")
    targets = typed(
        "target_modules",
        (str, list),
        None,
        lambda v: isinstance(v, str) or (v and all(isinstance(t, str) for t in v)),
        'a module name, a list of them or "all-linear"',
    )
    if isinstance(targets, str) and targets != "all-linear":
        targets = [targets]
    try:
        return LoraConfig(
            rank=rank,
            alpha=float(alpha),
            targets=targets if isinstance(targets, str) else tuple(targets),
            rslora=rslora,
            dropout=float(dropout),
            dtype=dtype,
        )
    except (TypeError, ValueError) as error:
        raise refuse(f"not a LoRA config this library can use ({error}).") from error


def read_adapter_config(path: str | os.PathLike, *, dtype=jnp.float32) -> LoraConfig:
    """The :class:`LoraConfig` of a PEFT adapter directory (its ``adapter_config.json``),
    the adapters in ``dtype``.

    Raises:
      FileNotFoundError: no ``adapter_config.json`` there.
      ValueError: not JSON, not plain LoRA, or a value of the wrong type (named).
    """
    where = pathlib.Path(path)
    if not (where / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"load_adapter: {where} has no {ADAPTER_CONFIG} (a PEFT adapter directory has both).")
    try:
        peft_config = json.loads((where / ADAPTER_CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"load_adapter: {where / ADAPTER_CONFIG} is not valid JSON ({error}).") from None
    return _lora_config_from_peft(peft_config, where, dtype)


def _read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file. Raises ValueError naming the file if it cannot be read."""
    try:
        with safe_open(path, framework="numpy") as file:
            return {name: file.get_tensor(name) for name in file.keys()}
    except Exception as error:  # safetensors' own error type, or an OSError
        raise ValueError(f"load_adapter: {path} cannot be read (truncated or not safetensors?): {error}") from None


def load_adapter(path: str | os.PathLike, model: Model, *, dtype=jnp.float32) -> tuple[Model, Params]:
    """Reads a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    for ``model`` (the base the adapter was trained on): the LoRA model and its adapters, in
    ``dtype``. Someone's SFT adapter becomes a starting policy: ``combine(base, adapters)``.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: what this library cannot run (DoRA, biases, other modules, rank patterns),
        or tensors that do not fit ``model`` (names missing or extra, shapes), named.
    """
    if model.config.lora is not None:
        raise ValueError("load_adapter: `model` has adapters already; pass its base (lora.base_model).")
    where = pathlib.Path(path)
    lora = read_adapter_config(where, dtype=dtype)
    if not (where / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"load_adapter: {where} has no {ADAPTER_WEIGHTS} (a PEFT adapter directory has both).")
    lora_model = adapted(model, lora)
    specs = _adapter_shapes(dataclasses.replace(lora_model.config, scan_layers=False))  # PEFT's: per layer
    tensors = _read_tensors(where / ADAPTER_WEIGHTS)
    # PEFT names a tensor by its module path, with the adapter's name (".default") or without.
    stored = {name.replace(".default.", "."): name for name in tensors}
    expected = {peft_name(path): path for path in specs}
    missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or extra:
        found = [f"{len(missing)} missing ({', '.join(missing[:3])})" if missing else "",
                 f"{len(extra)} unexpected ({', '.join(extra[:3])})" if extra else ""]  # fmt: skip
        raise ValueError(
            f"load_adapter: the tensors of {where / ADAPTER_WEIGHTS} do not fit the model with {lora}: "
            f"{'; '.join(part for part in found if part)}."
        )
    leaves = {}
    for name, path in expected.items():
        shape = specs[path].get_value().shape
        tensor = tensors[stored[name]]  # [r, in] or [out, r]
        is_a = path[-1].endswith("_lora_a")
        flat = (int(np.prod(shape[:-1])), shape[-1]) if is_a else (shape[0], int(np.prod(shape[1:])))
        if tensor.T.shape != flat:
            raise ValueError(f"load_adapter: {name} has shape {tuple(tensor.shape)}; the model needs {flat[::-1]}.")
        leaves[path] = specs[path].replace(jnp.asarray(tensor.T.reshape(shape), dtype))
    adapters = nnx.from_flat_state(leaves)
    return lora_model, stack_layers(adapters) if lora_model.config.scan_layers else adapters
