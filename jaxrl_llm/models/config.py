"""The decoder's configuration, and its mapping to and from Hugging Face configs."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

import jax.numpy as jnp

from jaxrl_llm import _checks

Architecture = Literal["llama", "mistral", "qwen2", "qwen3"]
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ROPE_TYPES = ("default", "llama3")
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "dot_product_attention", "cudnn")
EXECUTION_OPTIONS = ("remat", "attention")
"""The fields of :class:`ModelConfig` that choose how the model runs, not what it is: no
effect on the parameters or (up to float rounding) the outputs, never written to a
Hugging Face config."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections LoRA can adapt, by PEFT's names (``"all-linear"`` is all of them: PEFT's
all-linear leaves the output layer out, as here)."""


QUANTIZATIONS = ("int8",)
"""How a frozen base's projections may be stored (:mod:`jaxrl_llm.models.quantize`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    r"""Low-rank adapters (Hu et al., 2021) on the projections ``targets``, PEFT's way.

    A targeted projection :math:`W` (``[in, out]``) gains :math:`A` (``[in, r]``) and
    :math:`B` (``[r, out]``), and computes :math:`y = x W + s\,(x A) B` with the scale
    :math:`s = \alpha / r`, or :math:`\alpha / \sqrt{r}` with ``rslora`` (Kalajdzievski,
    2023). :math:`A` starts Kaiming-uniform (bound :math:`1/\sqrt{in}`, PEFT's default) and
    :math:`B` at zero, so at initialisation the adapted model is the base exactly.
    """

    rank: int = 16
    """``r``, PEFT's ``r``."""
    alpha: float = 32.0
    """PEFT's ``lora_alpha``."""
    targets: tuple[str, ...] | str = "all-linear"
    """Projection names from :data:`LORA_TARGETS`, or ``"all-linear"`` (PEFT's ``target_modules``);
    normalised to a tuple in :data:`LORA_TARGETS`' order."""
    rslora: bool = False
    r"""Scale by :math:`\alpha / \sqrt{r}` (PEFT's ``use_rslora``)."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout``: the probability of zeroing each input of an adapter (the
    survivors scaled by ``1 / (1 - dropout)``) in the update's training pass; never in
    decoding or in the scored old and reference log-probs (TRPO, whose step computes its own
    old log-probs, computes them with the step's masks)."""
    dtype: Any = jnp.float32
    """Storage dtype of the adapters (the trained weights; the base keeps its own)."""

    def __post_init__(self):
        _checks.positive_int("LoraConfig", "rank", self.rank)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraConfig: `alpha` must be a number > 0; got {self.alpha!r}.")
        targets = self.targets
        if targets == "all-linear":
            targets = LORA_TARGETS
        elif isinstance(targets, str):
            targets = (targets,)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise ValueError(
                f"LoraConfig: `targets` must be 'all-linear' or names from {', '.join(map(repr, LORA_TARGETS))}; "
                f"got {self.targets!r}."
            )
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in targets))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig: `dropout` must be a number in [0, 1); got {self.dropout!r}.")
        object.__setattr__(self, "dropout", float(self.dropout))
        if not isinstance(self.rslora, bool):
            raise ValueError(f"LoraConfig: `rslora` must be True or False; got {self.rslora!r}.")
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype not in [jnp.dtype(d) for d in _DTYPES.values()]:
            raise ValueError(f"LoraConfig: `dtype` must be one of {', '.join(_DTYPES)}; got {self.dtype!r}.")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def scale(self) -> float:
        """:math:`s`: ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``rslora``."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding (Su et al., 2021) in the Hugging Face half-split layout."""

    theta: float = 10000.0
    """Base of the inverse frequencies ``theta ** (-2i / head_dim)``."""
    rope_type: str = "default"
    """``default`` or ``llama3`` (Llama 3.1's frequency-dependent scaling)."""
    factor: float = 1.0
    """``llama3``: scale of the low frequencies."""
    low_freq_factor: float = 1.0
    """``llama3``: wavelengths above ``original_max_position_embeddings / low_freq_factor``
    are scaled by ``1 / factor``."""
    high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``original_max_position_embeddings / high_freq_factor``
    are kept; those in between are interpolated."""
    original_max_position_embeddings: int = 8192
    """``llama3``: the context length the model was pre-trained with."""

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RopeConfig: `rope_type` must be one of {', '.join(map(repr, ROPE_TYPES))}; got {self.rope_type!r}."
            )
        if not self.theta > 0:
            raise ValueError(f"RopeConfig: `theta` must be > 0; got {self.theta}.")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeConfig: llama3 needs high_freq_factor > low_freq_factor; got {self.high_freq_factor} "
                f"and {self.low_freq_factor}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer of the Llama family (Llama 3, Mistral, Qwen2, Qwen3).

    Pre-norm blocks of RMSNorm, grouped-query attention with RoPE, and a SwiGLU MLP.
    The families differ only in switches: Qwen2 has biases on q/k/v, Qwen3 an RMSNorm on
    each head of q and k, Mistral a sliding attention window.

    The last three fields are not architecture: :meth:`to_hf` leaves them out and
    :meth:`from_hf` gives the defaults. ``scan_layers`` is the layers' params layout
    (:func:`jaxrl_llm.models.with_scan_layers` converts a model you have); ``remat`` and
    ``attention`` (:data:`EXECUTION_OPTIONS`) are execution settings
    (:func:`jaxrl_llm.models.with_options`).
    """

    architecture: Architecture = "llama"
    """Which Hugging Face family the weights and config follow."""
    vocab_size: int = 512
    hidden_size: int = 256
    """d_model."""
    intermediate_size: int = 1024
    """Width of the SwiGLU MLP."""
    num_layers: int = 4
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 4
    """Key/value heads; ``num_heads`` must be a multiple (grouped-query attention)."""
    head_dim: int = 64
    max_position_embeddings: int = 2048
    """Longest sequence (prompt plus completion) the model accepts."""
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2: always; Llama/Qwen3: optional)."""
    output_bias: bool = False
    """A bias on the attention output projection (Llama/Qwen3 with attention_bias; never
    in Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over ``head_dim`` on each query and key head before RoPE (Qwen3)."""
    sliding_windows: tuple[int | None, ...] | None = None
    """Per layer: attend to at most this many most recent positions, or ``None`` (full).
    ``None`` for the whole field means full attention everywhere."""
    bos_token_id: int | None = None
    """Token ids carried over from (and back to) the Hugging Face config."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids: the sampler's default stop tokens."""
    pad_token_id: int | None = None
    param_dtype: Any = jnp.float32
    """Storage dtype of the parameters."""
    dtype: Any = jnp.float32
    """Compute dtype of matmuls and activations (norms, softmax and RoPE run in float32)."""
    lora: LoraConfig | None = None
    """Low-rank adapters on the projections (:mod:`jaxrl_llm.models.lora`): their weights
    are params of the model beside the base's. Not part of a Hugging Face config."""
    quantization: str | None = None
    r"""``"int8"``: the seven projections (:data:`LORA_TARGETS`) are stored as int8 with a
    float32 scale per output channel, ``{name}_scale``, and computed as :math:`(x Q) \cdot s`
    (:mod:`jaxrl_llm.models.quantize`): a base a byte per projection weight, for LoRA over
    it; such params are not trained. ``None``: ``param_dtype``. Not part of a Hugging Face
    config."""
    scan_layers: bool = False
    """The decoder layers' layout, and how they run. ``True``: each weight kind stored as one
    stacked ``[L, ...]`` leaf (leading logical axis ``layers``, never split) and the layers
    run as one ``jax.lax.scan`` in every pass: teacher-forced ones, both passes of
    :func:`jaxrl_llm.models.functional.group_completion_hidden_states`, the prefill and each
    decoding step. The program holds one layer, not ``L``, so tracing, lowering and
    compiling stop growing with depth; the scan reads each layer's weights out of the
    stacks and writes their gradients into stacked leaves, with no copy of the whole. The KV
    cache is stacked ``[L, B, KVH, K, D]`` (:class:`jaxrl_llm.models.KVCache`) and updated
    in place by the scan. ``False``: one params subtree per layer (Hugging Face's layout), run
    by a Python loop: XLA's CPU backend compiles the identical kernels of unrolled layers
    once, and there small unrolled models decode faster (a scan copies each layer's weights
    out of the stacks at every step). A layout, not an execution option: it decides the
    params' tree (:func:`jaxrl_llm.models.with_scan_layers` converts a model and its
    params). Measured in docs/performance.md (``benchmarks/compile_depth.py``,
    ``benchmarks/layer_scan.py``, ``benchmarks/sampler.py``)."""
    remat: str = "none"
    """Rematerialisation (``jax.checkpoint``) of each decoder layer in the backward pass:
    ``none`` (keep what the backward pass needs), ``full`` (keep each layer's input only:
    ``nothing_saveable``) or ``dots`` (keep the outputs of matmuls without batch dimensions,
    the weight projections, and recompute attention and the elementwise ops:
    ``dots_with_no_batch_dims_saveable``). On XLA's CPU backend only the scanned layers
    (``scan_layers``) give the memory back; unrolled ones pay the recomputation without
    lowering the peak."""
    attention: str = "auto"
    """Softmax attention kernel: ``xla`` (:func:`jaxrl_llm.models.decoder.attend`, its
    backward pass tuned for XLA's CPU backend), ``dot_product_attention``
    (``jax.nn.dot_product_attention`` with JAX's default implementation, which in JAX 0.10
    is its XLA one on every backend), ``cudnn`` (its cuDNN flash attention: NVIDIA GPUs,
    ``dtype`` bfloat16 or float16) or ``auto``: ``xla`` when JAX's default backend is the
    CPU, else ``dot_product_attention`` (read when the function is traced)."""

    def __post_init__(self):
        def fail(message):
            raise ValueError(f"ModelConfig: {message}")

        if self.architecture not in ARCHITECTURES:
            fail(f"`architecture` must be one of {', '.join(map(repr, ARCHITECTURES))}; got {self.architecture!r}.")
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _checks.positive_int("ModelConfig", field, getattr(self, field))
        if self.num_heads % self.num_kv_heads:
            fail(f"`num_heads` ({self.num_heads}) must be a multiple of `num_kv_heads` ({self.num_kv_heads}).")
        if self.head_dim % 2:
            fail(f"`head_dim` must be even for RoPE; got {self.head_dim}.")
        if not self.rms_norm_eps > 0:
            fail(f"`rms_norm_eps` must be > 0; got {self.rms_norm_eps}.")
        if self.qk_norm != (self.architecture == "qwen3"):
            fail(
                f"`qk_norm` (RMSNorm on q and k heads) is Qwen3's and only Qwen3's; got qk_norm={self.qk_norm} "
                f"for {self.architecture!r}."
            )
        if self.architecture == "mistral" and self.attention_bias:
            fail("mistral has no attention biases: attention_bias must be False.")
        if self.architecture == "qwen2" and (not self.attention_bias or self.output_bias):
            fail("qwen2 has biases on q/k/v and none on the output: attention_bias=True, output_bias=False.")
        if self.architecture != "qwen2" and self.output_bias != self.attention_bias:
            fail(
                f"{self.architecture}'s attention_bias covers q/k/v and the output alike: "
                f"output_bias must equal attention_bias ({self.attention_bias})."
            )
        if self.sliding_windows is not None and len(self.sliding_windows) != self.num_layers:
            fail(f"`sliding_windows` needs one entry per layer ({self.num_layers}); got {len(self.sliding_windows)}.")
        for field in ("param_dtype", "dtype"):
            value = getattr(self, field)
            try:
                canonical = jnp.dtype(value)
            except TypeError:
                canonical = None
            if canonical not in [jnp.dtype(d) for d in _DTYPES.values()]:
                fail(f"`{field}` must be one of {', '.join(_DTYPES)}; got {value!r}.")
            # One canonical object, so that equal configs hash equally (no retraces).
            object.__setattr__(self, field, canonical)
        windows = [w for w in (self.sliding_windows or ()) if w is not None]
        if any(not (isinstance(w, int) and w >= 1) for w in windows):
            fail(f"`sliding_windows` entries must be integers >= 1 or None; got {self.sliding_windows}.")
        if windows and self.architecture == "llama":
            fail("llama has no sliding-window attention: `sliding_windows` must be None.")
        if (
            self.architecture == "mistral"
            and self.sliding_windows is not None
            and (len(windows) != self.num_layers or len(set(windows)) != 1)
        ):
            fail(f"mistral uses one window in every layer; got sliding_windows={self.sliding_windows}.")
        if len(set(windows)) > 1:
            fail(f"{self.architecture} uses a single window size; got sliding_windows={self.sliding_windows}.")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))
        if not isinstance(self.scan_layers, bool):
            fail(f"`scan_layers` must be True or False; got {self.scan_layers!r}.")
        _checks.one_of("ModelConfig", "remat", self.remat, REMAT_POLICIES)
        _checks.one_of("ModelConfig", "attention", self.attention, ATTENTION_IMPLEMENTATIONS)
        if self.quantization is not None:
            _checks.one_of("ModelConfig", "quantization", self.quantization, (None, *QUANTIZATIONS))
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            fail(f"`lora` must be a LoraConfig or None; got {type(self.lora).__name__}.")
        if self.attention == "cudnn" and self.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            fail(f"attention='cudnn' (cuDNN flash attention) computes in bfloat16 or float16; got dtype {self.dtype}.")

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (``None``: full causal attention)."""
        return None if self.sliding_windows is None else self.sliding_windows[layer]

    # --- Hugging Face -------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_config: Any, *, param_dtype: Any = jnp.float32, dtype: Any | None = None) -> ModelConfig:
        """From a ``transformers`` config object (e.g. ``AutoConfig.from_pretrained(dir)``).

        Raises ``ValueError`` naming the supported families, or the unsupported option.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in ARCHITECTURES:
            supported = ", ".join(f"{a} ({_HF_CLASSES[a]})" for a in ARCHITECTURES)
            raise ValueError(f"Unsupported architecture {model_type!r}; supported: {supported}.")
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r} for {model_type}; only 'silu' (SwiGLU) is supported.")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError(f"Unsupported option mlp_bias=True for {model_type}.")
        rope = _rope_from_hf(hf_config)
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        num_layers = hf_config.num_hidden_layers
        return cls(
            architecture=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=hf_config.max_position_embeddings,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope=rope,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(getattr(hf_config, "attention_bias", False)),
            output_bias=model_type != "qwen2" and bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_windows_from_hf(hf_config, model_type, num_layers),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=_as_tuple(getattr(hf_config, "eos_token_id", None)),
            pad_token_id=getattr(hf_config, "pad_token_id", None),
            param_dtype=param_dtype,
            dtype=param_dtype if dtype is None else dtype,
        )

    def to_hf(self) -> Any:
        """The ``transformers`` config of the same model (for ``save_pretrained``)."""
        import transformers

        rope_parameters = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "llama3":
            rope_parameters.update(
                factor=self.rope.factor,
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        kwargs: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope_parameters,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu",
            architectures=[_HF_CLASSES[self.architecture]],
            dtype=jnp.dtype(self.param_dtype).name,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids)
            if len(self.eos_token_ids) > 1
            else (self.eos_token_ids[0] if self.eos_token_ids else None),
            pad_token_id=self.pad_token_id,
        )
        # __post_init__ guarantees at most one window size.
        window = next((w for w in (self.sliding_windows or ()) if w is not None), None)
        if self.architecture in ("llama", "qwen3"):
            kwargs["attention_bias"] = self.attention_bias
        if self.architecture == "mistral":
            kwargs["sliding_window"] = window
        elif self.architecture in ("qwen2", "qwen3"):
            kwargs["use_sliding_window"] = window is not None
            kwargs["sliding_window"] = window
            if window is not None:
                kwargs["layer_types"] = [
                    "full_attention" if w is None else "sliding_attention" for w in self.sliding_windows
                ]
        config_class = getattr(transformers, _HF_CLASSES[self.architecture].replace("ForCausalLM", "Config"))
        return config_class(**kwargs)


def _as_tuple(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(int(i) for i in ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def _rope_from_hf(hf_config: Any) -> RopeConfig:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    # transformers 4 spelled these as rope_theta + rope_scaling.
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}.")
    if rope_type == "default":
        return RopeConfig(theta=float(params["rope_theta"]))
    return RopeConfig(
        theta=float(params["rope_theta"]),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _windows_from_hf(hf_config: Any, model_type: str, num_layers: int) -> tuple[int | None, ...] | None:
    window = getattr(hf_config, "sliding_window", None)
    if model_type == "mistral":
        return None if window is None else (int(window),) * num_layers
    if model_type in ("qwen2", "qwen3") and getattr(hf_config, "use_sliding_window", False) and window:
        layer_types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * num_layers
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return None


def dtype_from_name(name: str | Any) -> Any:
    """``"bfloat16"`` (or a dtype) -> the JAX dtype; the error lists the allowed names."""
    if not isinstance(name, str):
        return name
    if name not in _DTYPES:
        raise ValueError(f"Unsupported dtype {name!r}; allowed: {', '.join(_DTYPES)}.")
    return _DTYPES[name]
