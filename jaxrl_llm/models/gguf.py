"""GGUF checkpoints (llama.cpp's single-file format) in both directions.

Reading (:func:`find_file`, :func:`read_config`, :class:`GgufTensors`, :func:`load_tokenizer`;
:func:`jaxrl_llm.models.from_pretrained` and :func:`jaxrl_llm.models.load_tokenizer` call
them for a ``.gguf`` path): the config comes from the file's metadata, every tensor is
dequantized to float32 by the ``gguf`` package (every GGML type it knows: F32, F16, BF16,
Q4_0 ... Q8_0, the K-quants, the I-quants, TQ1_0, TQ2_0, MXFP4) and given to
:func:`jaxrl_llm.models.layout.read_weights` under its Hugging Face name, so a GGUF loads
exactly as the same weights saved as safetensors would, mesh and int8 base included. The
tokenizer and chat template come from the metadata through transformers' GGUF tokenizer
builders; nothing goes through torch.

Writing (:func:`save_gguf`, ``jaxrl-llm export --format gguf``): the architecture's
metadata, the tokenizer (vocabulary, merges, token types, special ids, chat template) and
the weights as F32, F16, BF16 or a block quantization (Q8_0, Q5_1, Q5_0, Q4_1, Q4_0), the
file llama.cpp and the runtimes built on it (Ollama, LM Studio, llama-cpp-python) run.

llama.cpp's conventions, which both directions follow: a ``llama`` file stores the query
and key projections with the rotary pairs interleaved (its ``permute``), where Hugging Face
splits them in halves; Qwen2 and Qwen3 files store them as they are. Mistral is ``llama``
in GGUF, without the sliding window (llama.cpp has none for it). Llama 3.1's rotary scaling
is a ``rope_freqs.weight`` tensor of per-frequency divisors. Norms and biases are float32
in every file type, and a matrix whose rows a block quantization cannot split (a row length
not a multiple of 32) is written as F16, as llama.cpp's converter does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import gguf as gguf_lib
import jax.numpy as jnp
import numpy as np
import transformers
from tokenizers import pre_tokenizers

from jaxrl_llm.models import layout, lora, quantize
from jaxrl_llm.models.config import ModelConfig, RopeConfig, dtype_from_name
from jaxrl_llm.models.functional import Model, Params

SUFFIX = ".gguf"

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""Our architecture -> llama.cpp's (``general.architecture``); a ``llama`` file loads as ``llama``."""

FILE_TYPES: dict[str, gguf_lib.GGMLQuantizationType] = {
    "f32": gguf_lib.GGMLQuantizationType.F32,
    "f16": gguf_lib.GGMLQuantizationType.F16,
    "bf16": gguf_lib.GGMLQuantizationType.BF16,
    "q8_0": gguf_lib.GGMLQuantizationType.Q8_0,
    "q5_1": gguf_lib.GGMLQuantizationType.Q5_1,
    "q5_0": gguf_lib.GGMLQuantizationType.Q5_0,
    "q4_1": gguf_lib.GGMLQuantizationType.Q4_1,
    "q4_0": gguf_lib.GGMLQuantizationType.Q4_0,
}
"""What :func:`save_gguf` writes the matrices as (llama.cpp's ``--outtype`` names)."""

_LLAMA_FILE_TYPES = {
    "f32": gguf_lib.LlamaFileType.ALL_F32,
    "f16": gguf_lib.LlamaFileType.MOSTLY_F16,
    "bf16": gguf_lib.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf_lib.LlamaFileType.MOSTLY_Q8_0,
    "q5_1": gguf_lib.LlamaFileType.MOSTLY_Q5_1,
    "q5_0": gguf_lib.LlamaFileType.MOSTLY_Q5_0,
    "q4_1": gguf_lib.LlamaFileType.MOSTLY_Q4_1,
    "q4_0": gguf_lib.LlamaFileType.MOSTLY_Q4_0,
}

# Hugging Face tensor name <-> GGUF tensor name (llama.cpp's `tensor_mapping.py`).
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_FROM_LAYER_NAMES = {value: key for key, value in _LAYER_NAMES.items()}
_ROPE_FREQS = "rope_freqs.weight"


def gguf_name(hf_name: str) -> str:
    """A Hugging Face tensor name -> its GGUF name (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``). Raises KeyError for a name GGUF has no place for."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise KeyError(f"No GGUF name for tensor {hf_name!r}.")
    return f"blk.{match[1]}.{_LAYER_NAMES[match[2]]}"


def hf_tensor_name(name: str) -> str | None:
    """A GGUF tensor name -> its Hugging Face name, or ``None`` for one without
    (``rope_freqs.weight``, or a tensor of another architecture)."""
    for hf, ours in _GLOBAL_NAMES.items():
        if name == ours:
            return hf
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if match is None or match[2] not in _FROM_LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_FROM_LAYER_NAMES[match[2]]}"


# --- Reading ---------------------------------------------------------------------------------------


def find_file(path: str | os.PathLike) -> pathlib.Path | None:
    """The GGUF file ``path`` names: ``path`` itself if it ends in ``.gguf``, or the one
    ``.gguf`` file of a directory without a ``config.json``; ``None`` for anything else (a
    Hugging Face directory).

    Raises:
      FileNotFoundError: ``path`` ends in ``.gguf`` and is no file.
      ValueError: the directory holds several ``.gguf`` files (names them).
    """
    path = pathlib.Path(path).expanduser()
    if path.suffix.lower() == SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"No GGUF file at {path}.")
        return path.resolve()
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(files) > 1:
        raise ValueError(
            f"{path} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); name the one to load."
        )
    return files[0].resolve() if files else None


class _Metadata(Mapping[str, Any]):
    """A GGUF file's key-value metadata, every value decoded; a list is handed out as a copy
    (the cached parse it comes from is shared)."""

    def __init__(self, values: dict[str, Any]):
        self._values = values

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        return list(value) if isinstance(value, list) else value

    def __contains__(self, key: object) -> bool:  # without copying the value, as Mapping's would
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclasses.dataclass(frozen=True)
class _Parsed:
    """A GGUF file parsed: its metadata and its tensors (views of the mapped file, read on use)."""

    metadata: _Metadata
    tensors: tuple[gguf_lib.ReaderTensor, ...]


def _parse(file: pathlib.Path) -> _Parsed:
    """``file`` parsed, or its parse from before if it has not changed since (the same path,
    inode, size and modification time): a run reads its model's config, tokenizer and
    checkpoint from one file, and ``gguf``'s reader takes seconds over a real model's
    metadata (a NumPy view of each of its vocabulary's and merges' strings)."""
    file = file.resolve()
    stat = file.stat()
    return _parse_version(file, (stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _parse_version(file: pathlib.Path, version: tuple[int, int, int]) -> _Parsed:
    """:func:`_parse` of ``file`` as it is at ``version`` (part of the cache's key). The
    reader's per-string views are dropped once decoded: a real model's are 170 MB."""
    del version
    try:
        reader = gguf_lib.GGUFReader(file)
    except (ValueError, OSError, IndexError, EOFError) as error:  # a truncated or foreign file
        raise ValueError(f"{file} is not a readable GGUF file: {error}") from error
    values = {name: field.contents() for name, field in reader.fields.items()}
    return _Parsed(_Metadata(values), tuple(reader.tensors))


def _float32_value(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (``1e-05``, not
    ``9.999999747378752e-06``): the number the model's own config had."""
    return float(str(np.float32(value)))


def read_config(file: str | os.PathLike, *, param_dtype: Any = jnp.float32, dtype: Any | None = None) -> ModelConfig:
    """The :class:`~jaxrl_llm.models.ModelConfig` a GGUF file's metadata describes.

    Raises:
      ValueError: an architecture other than llama, qwen2 and qwen3, an option the decoder
        does not have (a per-layer head count, partial rotary embeddings, rotary scaling other
        than Llama 3.1's), a required metadata key missing, or no ``token_embd.weight``
        tensor (whose shape gives the vocabulary size), naming it.
    """
    file = pathlib.Path(file)
    return _config(file, _parse(file), param_dtype=dtype_from_name(param_dtype), dtype=dtype)


def read_checkpoint(
    file: str | os.PathLike, *, param_dtype: Any = jnp.float32, dtype: Any | None = None
) -> tuple[ModelConfig, GgufTensors]:
    """:func:`read_config` and :class:`GgufTensors` of ``file``."""
    file = pathlib.Path(file)
    parsed = _parse(file)
    config = _config(file, parsed, param_dtype=param_dtype, dtype=dtype)
    return config, GgufTensors(file, config, tensors=parsed.tensors)


def _config(file: pathlib.Path, parsed: _Parsed, *, param_dtype: Any, dtype: Any | None) -> ModelConfig:
    meta = parsed.metadata
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(
            f"{file.name}: GGUF architecture {arch!r} is not supported; supported: llama (Llama, Mistral, SmolLM, "
            "...), qwen2, qwen3."
        )

    def field(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # a per-layer value
            if len(set(value)) != 1:
                raise ValueError(f"{file.name}: {arch}.{key} differs between layers ({value}); not supported.")
            value = value[0]
        return value

    def required(key: str) -> int:
        if (value := field(key)) is None:
            raise ValueError(f"{file.name}: its metadata has no {arch}.{key}; not a complete {arch} GGUF file.")
        return int(value)

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    tensors = {tensor.name: tensor for tensor in parsed.tensors}
    hidden, heads = required("embedding_length"), required("attention.head_count")
    head_dim = int(field("attention.key_length", 0) or hidden // heads)
    rotary = field("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"{file.name}: partial rotary embeddings ({rotary} of {head_dim} dims) are not supported.")
    scaling = field("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{file.name}: rotary scaling {scaling!r} is not supported (only Llama 3.1's rope_freqs).")
    theta = float(field("rope.freq_base", 10000.0))
    rope = RopeConfig(theta=theta)
    if _ROPE_FREQS in tensors:
        rope = _llama3_rope(np.asarray(tensors[_ROPE_FREQS].data, np.float32), theta=theta, head_dim=head_dim)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{file.name} has no token_embd.weight: not a {arch} model's weights.")
    vocab = int(field("vocab_size") or tensors["token_embd.weight"].shape[1])  # GGML: [hidden, vocab]
    eos = [token_id(key) for key in ("eos_token_id", "eot_token_id")]
    param_dtype = dtype_from_name(param_dtype)
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_layers=required("block_count"),
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(field("context_length", 2048)),
        rms_norm_eps=_float32_value(field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        output_bias=arch != "qwen2" and "blk.0.attn_output.bias" in tensors,
        qk_norm=arch == "qwen3",
        bos_token_id=token_id("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        pad_token_id=token_id("padding_token_id"),
        param_dtype=param_dtype,
        dtype=param_dtype if dtype is None else dtype_from_name(dtype),
    )


_LLAMA3_BANDS = ((1.0, 4.0, 8192),)
"""Llama 3.1's (low_freq_factor, high_freq_factor, original_max_position_embeddings), the
bands every Llama 3.x model uses; a ``rope_freqs`` tensor is matched against them."""


def llama3_rope_factors(rope: RopeConfig, *, head_dim: int) -> np.ndarray:
    """Llama 3.1's rotary scaling as llama.cpp stores it: the divisor of each of the
    ``head_dim / 2`` frequencies (``rope_freqs.weight``; Hugging Face's ``llama3`` rope type)."""
    inv_freq = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    low_band = rope.original_max_position_embeddings / rope.low_freq_factor
    high_band = rope.original_max_position_embeddings / rope.high_freq_factor
    smooth = (rope.original_max_position_embeddings / wavelength - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    between = 1 / ((1 - smooth) / rope.factor + smooth)
    factors = np.where(wavelength < high_band, 1.0, np.where(wavelength > low_band, rope.factor, between))
    return factors.astype(np.float32)


def _llama3_rope(factors: np.ndarray, *, theta: float, head_dim: int) -> RopeConfig:
    """The ``llama3`` rope whose :func:`llama3_rope_factors` are ``factors``."""
    for low, high, original in _LLAMA3_BANDS:
        rope = RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(factors.max()),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
        expected = llama3_rope_factors(rope, head_dim=head_dim)
        if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-5, atol=0):
            return rope
    raise ValueError(
        "rope_freqs.weight holds a rotary scaling other than Llama 3.1's (low_freq_factor 1, high_freq_factor 4, "
        "original context 8192); not supported."
    )


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a ``llama`` query/key projection (``[heads * D, ...]``): each
    head's rotary halves interleaved as pairs."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`_permute`: Hugging Face's halves from llama.cpp's pairs."""
    return (
        weights.reshape(heads, weights.shape[0] // heads // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _rotary_heads(config: ModelConfig, hf_name: str) -> int | None:
    """How many heads to (un)permute ``hf_name`` by in a ``llama`` file: the query's or the
    key's (weights and biases); ``None`` for every other tensor, and in other files."""
    if ARCHITECTURES[config.architecture] != "llama":
        return None
    if ".self_attn.q_proj." in hf_name:
        return config.num_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_kv_heads
    return None


class _Slice:
    """One GGUF tensor as a :class:`~jaxrl_llm.models.layout.LazyTensor`: its Hugging Face
    shape, and its values read (dequantized) only when indexed."""

    def __init__(self, source: GgufTensors, name: str):
        self._source, self._name = source, name

    def get_shape(self) -> list[int]:
        return self._source.shape(self._name)

    def __getitem__(self, box: tuple[slice, ...]) -> np.ndarray:
        return self._source.get_tensor(self._name)[box]


class GgufTensors:
    """A GGUF file's tensors by Hugging Face name, dequantized to float32 in the Hugging
    Face layout (:class:`~jaxrl_llm.models.layout.TensorSource`); ``rope_freqs.weight``
    is read into the config instead (:func:`read_config`). The last tensor read is kept
    (read-only), so the shards a mesh takes of an unstacked parameter dequantize its tensor
    once, and no more than one dequantized tensor is held at a time.

    Raises:
      ValueError: a tensor with no Hugging Face name (of another architecture), naming it.
    """

    def __init__(
        self, file: str | os.PathLike, config: ModelConfig, *, tensors: Sequence[gguf_lib.ReaderTensor] | None = None
    ):
        """``tensors``: the file's, parsed already (:func:`read_checkpoint`: the same parse as ``config``'s)."""
        self.description = str(file)
        self._config = config
        self._tensors = {}  # Hugging Face name -> the reader's tensor
        for tensor in _parse(pathlib.Path(file)).tensors if tensors is None else tensors:
            if tensor.name == _ROPE_FREQS:
                continue
            name = hf_tensor_name(tensor.name)
            if name is None:
                raise ValueError(f"{file} has tensor {tensor.name!r}, which no {config.architecture} model has.")
            self._tensors[name] = tensor
        self._last: tuple[str | None, np.ndarray | None] = (None, None)

    def names(self) -> Collection[str]:
        return self._tensors.keys()

    def shape(self, name: str) -> list[int]:
        return [int(n) for n in reversed(self._tensors[name].shape)]  # GGML lists the innermost dimension first

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, name)

    def get_tensor(self, name: str) -> np.ndarray:
        if self._last[0] != name:
            tensor = self._tensors[name]
            values = gguf_lib.quants.dequantize(tensor.data, tensor.tensor_type)
            values = np.asarray(values, np.float32).reshape(self.shape(name))
            heads = _rotary_heads(self._config, name)
            values = values if heads is None else _unpermute(values, heads)
            values.flags.writeable = False  # the cached copy: a caller's in-place change would alter the next read
            self._last = (name, values)
        return self._last[1]


_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_DIGITS_THEN_GPT2 = ("smollm",)
"""llama.cpp's pre-tokenizers that split every digit off before GPT-2's pattern."""


def _builders():
    """transformers' GGUF tokenizer builders, imported when first needed: the import loads
    every tokenizer class it maps, which a run that reads no GGUF never uses."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    return gguf_tokenizer_mapping


def load_tokenizer(file: str | os.PathLike) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer a GGUF file's metadata describes, with its chat template and special
    tokens: transformers' GGUF builders (what ``AutoTokenizer.from_pretrained(dir,
    gguf_file=...)`` runs), fed from the ``gguf`` reader. llama.cpp's ``smollm``
    pre-tokenizer (every digit its own piece, then GPT-2's pattern) is set as llama.cpp
    splits, where transformers keeps GPT-2's. Padding is on the left, as RL prompts are.

    Raises:
      ValueError: the file has no tokenizer, or one transformers cannot build (names it).
    """
    file = pathlib.Path(file)
    meta = _parse(file).metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{file} holds no tokenizer (tokenizer.ggml.tokens).")
    builders = _builders()
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in builders.GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, _ = builders.convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    if tokenizer_dict.get("pre_tokenizer_type") in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **tokenizer_config)


# --- Writing ---------------------------------------------------------------------------------------

_SPLIT_NAMES: dict[str, str] = {}
"""A byte-level pre-tokenizer's split pattern -> llama.cpp's name for it (``tokenizer.ggml.pre``)."""


def _split_names() -> dict[str, str]:
    if not _SPLIT_NAMES:
        for name, pattern in _builders().GGUF_PRE_TOKENIZER_SPLITS.items():
            _SPLIT_NAMES.setdefault(pattern, name)
    return _SPLIT_NAMES


def _pre_tokenizer_name(pre: Mapping[str, Any] | None) -> str | None:
    """llama.cpp's name (``tokenizer.ggml.pre``) for a byte-level BPE tokenizer's
    pre-tokenizer (``tokenizer.json``'s ``pre_tokenizer``), or ``None`` if it has none."""
    if pre is None:
        return None
    kind = pre.get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True):
        return "gpt2"
    steps = pre.get("pretokenizers", []) if kind == "Sequence" else []
    kinds = [step.get("type") for step in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {})
        return _split_names().get(pattern.get("Regex", pattern.get("String")))
    return None


def _tokenizer_metadata(tokenizer: transformers.PreTrainedTokenizerBase, vocab_size: int) -> dict[str, Any]:
    """``tokenizer.*`` metadata for a byte-level BPE tokenizer (GPT-2's kind: Llama 3, Qwen,
    SmolLM, ...), its vocabulary padded with unused tokens to ``vocab_size`` (the embedding's
    rows), as llama.cpp's converter pads it.

    Raises:
      ValueError: another kind of tokenizer, or a pre-tokenizer llama.cpp has no name for.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"GGUF export needs a fast (tokenizers) tokenizer; got {type(tokenizer).__name__}.")
    spec = json.loads(backend.to_str())
    model, decoder = spec.get("model", {}), spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise ValueError(
            f"GGUF export writes byte-level BPE tokenizers (Llama 3, Qwen, SmolLM, GPT-2); this one is "
            f"{model.get('type')} with a {decoder.get('type')} decoder, which llama.cpp could not rebuild."
        )
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        raise ValueError(
            f"GGUF export: llama.cpp has no name for this tokenizer's pre-tokenizer "
            f"({json.dumps(spec.get('pre_tokenizer'))[:200]}); known: GPT-2's, SmolLM's digits, and the split "
            f"patterns {', '.join(sorted(set(_split_names().values())))}."
        )
    vocab = tokenizer.get_vocab()  # added tokens included
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"The tokenizer has ids up to {max(vocab.values())}; the model embeds {vocab_size}.")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf_lib.TokenType.UNUSED] * vocab_size
    for token, index in vocab.items():
        tokens[index], types[index] = token, gguf_lib.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        types[added["id"]] = gguf_lib.TokenType.CONTROL if added["special"] else gguf_lib.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id,
    }
    return {
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "ids": {key: value for key, value in ids.items() if value is not None},
        "add_bos": bool(getattr(tokenizer, "add_bos_token", False)),
        "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
    }


_SAMPLING = {
    "temperature": "add_sampling_temp",
    "top_k": "add_sampling_top_k",
    "top_p": "add_sampling_top_p",
    "min_p": "add_sampling_min_p",
}
"""The sampling defaults a GGUF file may carry -> the writer's method for each."""


def _tensor_type(array: np.ndarray, file_type: str) -> gguf_lib.GGMLQuantizationType:
    """``file_type``'s GGML type for ``array``: float32 for vectors (norms, biases), F16 for
    a matrix whose rows a block quantization cannot split."""
    wanted = FILE_TYPES[file_type]
    if array.ndim < 2:
        return gguf_lib.GGMLQuantizationType.F32
    block, _ = gguf_lib.GGML_QUANT_SIZES[wanted]
    if array.shape[-1] % block:
        return gguf_lib.GGMLQuantizationType.F16
    return wanted


def gguf_tensors(model: Model, params: Params, *, file_type: str = "f16") -> Iterator[tuple[str, np.ndarray, Any]]:
    """``(GGUF name, data, GGML type)`` for each tensor of a GGUF file of ``model``: the
    weights in llama.cpp's layout, quantized as ``file_type`` says, and for Llama 3.1's
    rotary scaling its ``rope_freqs.weight``."""
    config = model.config
    for name, array in layout.hf_tensors(model, params):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = np.asarray(array, np.float32)
        if (heads := _rotary_heads(config, name)) is not None:
            values = _permute(values, heads)
        kind = _tensor_type(values, file_type)
        yield gguf_name(name), gguf_lib.quants.quantize(values, kind), kind
    if config.rope.rope_type == "llama3":
        yield _ROPE_FREQS, llama3_rope_factors(config.rope, head_dim=config.head_dim), gguf_lib.GGMLQuantizationType.F32


def save_gguf(
    path: str | os.PathLike,
    model: Model,
    params: Params,
    *,
    tokenizer: transformers.PreTrainedTokenizerBase,
    file_type: str = "f16",
    name: str | None = None,
    eos_token_ids: Sequence[int] | None = None,
    sampling: Mapping[str, float] | None = None,
) -> pathlib.Path:
    """Writes ``model`` and ``tokenizer`` as one GGUF file that llama.cpp runs.

    The file holds the architecture's metadata (llama.cpp's keys), the tokenizer
    (byte-level BPE: vocabulary, merges, token types, bos/eos/pad ids, chat template) and
    the weights: matrices as ``file_type``, norms and biases as float32. A LoRA model is
    written merged, an int8 base dequantized. The file is written beside ``path`` and
    renamed into place when complete, so an interrupted export leaves no partial file.

    .. code-block:: python

        models.save_gguf("policy.q8_0.gguf", model, params, tokenizer=tokenizer, file_type="q8_0")
        # llama.cpp: llama-cli -m policy.q8_0.gguf; Ollama: FROM ./policy.q8_0.gguf

    Args:
      path: the file to write (``.gguf`` is appended if missing); its directory is created.
      model, params: the policy (from :func:`jaxrl_llm.models.from_pretrained`, a run's
        checkpoint, ...), of any family but with no sliding window.
      tokenizer: the model's tokenizer, a byte-level BPE one (GPT-2's kind: Llama 3, Qwen,
        SmolLM).
      file_type: the matrices' type: ``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q5_1"``,
        ``"q5_0"``, ``"q4_1"`` or ``"q4_0"``; F32 reads back exactly, the others within their
        rounding.
      name: ``general.name`` (default: the file's name without its suffix).
      eos_token_ids: the ids that end a completion (default: the model config's, else the
        tokenizer's EOS): the first is the file's EOS, a second its end-of-turn (EOT).
      sampling: llama.cpp's sampling defaults (``general.sampling.*``): ``temperature``,
        ``top_k``, ``top_p``, ``min_p``.

    Returns:
      The path written.

    Raises:
      ValueError: an unknown ``file_type`` or sampling setting (lists the allowed ones), a
        model with sliding windows, or a tokenizer llama.cpp could not rebuild (says why).
    """
    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file_type must be one of {', '.join(FILE_TYPES)}; got {file_type!r}.")
    sampling = dict(sampling or {})
    if unknown := sorted(set(sampling) - set(_SAMPLING)):
        raise ValueError(f"GGUF sampling settings are {', '.join(_SAMPLING)}; got {', '.join(unknown)}.")
    if model.config.lora is not None:
        model, params = lora.merge(model, params)
    model, params = quantize.dequantize(model, params)
    config = model.config
    if any(window is not None for window in config.sliding_windows or ()):
        raise ValueError("GGUF export: llama.cpp runs this architecture without a sliding window; the model has one.")
    target = pathlib.Path(path).expanduser()
    if target.suffix.lower() != SUFFIX:
        target = target.with_name(target.name + SUFFIX)
    tokens = _tokenizer_metadata(tokenizer, config.vocab_size)
    eos = list(eos_token_ids or config.eos_token_ids or [tokenizer.eos_token_id])
    tokens["ids"]["eos"] = eos[0]
    if len(eos) > 1:
        tokens["ids"]["eot"] = eos[1]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    arch = ARCHITECTURES[config.architecture]
    writer = gguf_lib.GGUFWriter(partial, arch)
    try:
        stem = name or target.name[: -len(SUFFIX)]
        _write_metadata(writer, config, tokens, name=stem, file_type=file_type, sampling=sampling)
        for tensor_name, data, kind in gguf_tensors(model, params, file_type=file_type):
            writer.add_tensor(tensor_name, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, target)
    except BaseException:
        writer.close()
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise
    return target


def _write_metadata(
    writer: gguf_lib.GGUFWriter,
    config: ModelConfig,
    tokens: dict[str, Any],
    *,
    name: str,
    file_type: str,
    sampling: Mapping[str, float],
) -> None:
    """The metadata :func:`save_gguf` writes: llama.cpp's keys for the architecture, the
    tokenizer (``tokens``: :func:`_tokenizer_metadata` with its stop ids) and the sampling defaults."""
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(_LLAMA_FILE_TYPES[file_type])
    if FILE_TYPES[file_type] not in (gguf_lib.GGMLQuantizationType.F32, gguf_lib.GGMLQuantizationType.F16):
        writer.add_quantization_version(gguf_lib.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope.theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokens["pre"])
    writer.add_token_list(tokens["tokens"])
    writer.add_token_types(tokens["types"])
    writer.add_token_merges(tokens["merges"])
    for key, value in tokens["ids"].items():
        getattr(writer, f"add_{key}_token_id")(value)
    writer.add_add_bos_token(tokens["add_bos"])
    if tokens["chat_template"] is not None:
        writer.add_chat_template(tokens["chat_template"])
    for key, value in sampling.items():
        getattr(writer, _SAMPLING[key])(value)
