"""Small GGUF files written the way llama.cpp's converter writes them, independently of the
library's own writer: a tiny byte-level BPE tokenizer, and a transformers model's weights
converted by this module (names, llama.cpp's rotary permutation, quantization) with the
``gguf`` package's writer.

Weights of GGML types the ``gguf`` package can only read (the K- and I-quants, NVFP4) are
random blocks: bytes below 0x28, so every float16 scale in them is finite and below 2**-5.
"""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 37 + 48? Reply with just the number.",
    "The answer is 85. Hello, world! Über café 日本語.",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nSolve 3 * 4<|im_end|>\n<|im_start|>assistant\n12<|im_end|>",
] * 20
PROBES = [
    "What is 12 + 345? Reply with just the number.",
    "  spaces   and\ttabs\n\nnew lines ÜBER 日本",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]

# The types the gguf package writes; the others are written as random blocks.
QUANTIZABLE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"}
READ_TYPES = [
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
    "NVFP4",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ1_S",
    "IQ1_M",
    "IQ4_NL",
    "IQ4_XS",
]
"""Every GGML type the gguf package dequantizes (``gguf.quants``), and the plain floats."""

# Hidden 256 and MLP 512: every row splits into 256-value blocks (the K- and I-quants').
GGUF_TINY = dict(
    vocab_size=None,  # the tokenizer's
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=128,
)


def bpe_tokenizer(*, vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's kind) trained on :data:`CORPUS`, with ChatML."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML,
    )


def tiny_gguf_hf_model(family: str, tokenizer, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random float32 transformers model for ``tokenizer``, every parameter perturbed."""
    config_name, model_name = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    settings = {**GGUF_TINY, "vocab_size": len(tokenizer), **overrides}
    if family == "qwen3":  # transformers' GGUF reader gives Qwen3 its default head_dim, 128
        settings.update(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    config = getattr(transformers, config_name)(
        **settings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(name: str) -> str:
    if name in _NAMES:
        return _NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_NAMES[rest]}"


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def random_blocks(rows: int, columns: int, qtype: gguf.GGMLQuantizationType, rng) -> np.ndarray:
    """``[rows, columns]`` values' worth of ``qtype`` blocks of random bytes below 0x28."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 0x28, size=(rows, columns // block * size), dtype=np.uint8)


def write_gguf(
    path: pathlib.Path,
    hf_model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerFast,
    *,
    qtype: str = "F32",
    seed: int = 0,
    leave_out: tuple[str, ...] = (),
) -> pathlib.Path:
    """``hf_model`` and ``tokenizer`` as a GGUF file, its matrices as ``qtype``, without the
    tensors named in ``leave_out`` (Hugging Face names)."""
    config = hf_model.config
    arch = config.model_type
    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    specials = set(tokenizer.all_special_tokens)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    for name, tensor in hf_model.state_dict().items():
        if (name == "lm_head.weight" and config.tie_word_embeddings) or name in leave_out:
            continue
        values = tensor.float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in name:
            values = _llama_cpp_permute(values, config.num_attention_heads)
        if arch == "llama" and ".self_attn.k_proj." in name:
            values = _llama_cpp_permute(values, config.num_key_value_heads)
        if values.ndim == 1:
            writer.add_tensor(_gguf_name(name), values)
        elif qtype in QUANTIZABLE:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), random_blocks(*values.shape, kind, rng), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
