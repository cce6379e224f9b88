"""The policy model: a Flax NNX decoder of the Llama family with Hugging Face interop.

.. code-block:: python

    model, params = models.from_pretrained("path/to/checkpoint", dtype=jnp.bfloat16)
    logits = models.forward(model, params, tokens, attention_mask=mask)  # [B, S, V]
    models.save_pretrained("path/to/out", model, params)  # weights and config
    # A complete export: also the tokenizer (chat template included) and generation_config.json.
    models.save_pretrained("path/to/out", model, params, tokenizer=tokenizer)
    # GGUF (llama.cpp's format) in and out: any GGML type read, dequantized; F32 ... Q4_0 written.
    model, params = models.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = models.load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
    models.save_gguf("policy.gguf", model, params, tokenizer=tokenizer, file_type="q8_0")
    # Execution options for the same params: each layer rematerialised in the backward pass.
    model = models.with_options(model, remat="dots")
    # The layers stacked [L, ...] and run as one scan (or load them so: from_pretrained(..., scan_layers=True)).
    model, params = models.with_scan_layers(model, params, True)
    # Low-rank adapters over the frozen base (models.lora): the adapters a pytree of their own.
    lora_model, adapters = models.lora.add_adapters(model, models.LoraConfig(rank=16), key)
    # An int8 base for LoRA (models.quantize): projections a byte per weight, quantized as read.
    model, params = models.from_pretrained("path/to/checkpoint", jnp.bfloat16, quantization="int8")

``model`` is static (config and graph definition); ``params`` is an immutable pytree.

The package exports what a user calls; the library's own helpers stay in their modules
(``models.functional.group_completion_hidden_states``, the train step's shared-prompt pass;
``models.config.EXECUTION_OPTIONS``, ...).
"""

from jaxrl_llm.models import gguf, lora, quantize
from jaxrl_llm.models.config import LoraConfig, ModelConfig, RopeConfig
from jaxrl_llm.models.decoder import KVCache
from jaxrl_llm.models.functional import (
    COMPUTE_DTYPE_PARAMS,
    Model,
    Params,
    abstract,
    completion_hidden_states,
    completion_logprobs,
    decode_step,
    extend,
    forward,
    hidden_states,
    in_compute_dtype,
    init,
    init_cache,
    logits_from_hidden,
    output_kernel,
    prefill,
    with_options,
    with_scan_layers,
)
from jaxrl_llm.models.gguf import save_gguf
from jaxrl_llm.models.hf import from_pretrained, read_config, save_pretrained
from jaxrl_llm.models.tokenizer import load_tokenizer, save_tokenizer
from jaxrl_llm.sharding import logical_axes  # the names the params carry: the sharding rules' keys

__all__ = [
    "COMPUTE_DTYPE_PARAMS",
    "KVCache",
    "LoraConfig",
    "Model",
    "ModelConfig",
    "Params",
    "RopeConfig",
    "abstract",
    "completion_hidden_states",
    "completion_logprobs",
    "decode_step",
    "extend",
    "forward",
    "from_pretrained",
    "gguf",
    "hidden_states",
    "in_compute_dtype",
    "init",
    "init_cache",
    "load_tokenizer",
    "logical_axes",
    "logits_from_hidden",
    "lora",
    "output_kernel",
    "prefill",
    "quantize",
    "read_config",
    "save_gguf",
    "save_pretrained",
    "save_tokenizer",
    "with_options",
    "with_scan_layers",
]
