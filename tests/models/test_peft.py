"""LoRA adapters in PEFT's format, against ``peft`` itself: an adapter saved here loads in
``peft.PeftModel`` with our logits, and one that ``peft`` made loads here with its logits.

``peft`` and torch are imported unconditionally: missing, these tests fail, never skip.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

from jaxrl_llm import models
from jaxrl_llm.models import lora
from tests.models.hf_fixtures import hf_logits, left_padded_batch, tiny_hf_model
from tests.models.test_lora import perturbed

CASES = {
    "llama-all-linear": ("llama", models.LoraConfig(rank=4, alpha=8.0)),
    "qwen2-q-v-rslora": ("qwen2", models.LoraConfig(rank=3, alpha=6.0, targets=("q_proj", "v_proj"), rslora=True)),
    "qwen3-o-down": ("qwen3", models.LoraConfig(rank=2, alpha=5.0, targets=("o_proj", "down_proj"))),
    "mistral-mlp": ("mistral", models.LoraConfig(rank=4, alpha=4.0, targets=("gate_proj", "up_proj", "down_proj"))),
}


def ours(model, params, tokens, mask):
    return np.asarray(models.forward(model, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask)))


@pytest.mark.parametrize("case", list(CASES))
def test_an_adapter_saved_here_loads_in_peft_with_our_logits(case, tmp_path):
    family, lora_config = CASES[case]
    tiny_hf_model(family).save_pretrained(tmp_path / "base")
    model, base = models.from_pretrained(tmp_path / "base")
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(0))
    params = lora.combine(base, perturbed(adapters))
    lora.save_adapter(tmp_path / "adapter", lora_model, params, base_model_name_or_path=str(tmp_path / "base"))

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    tokens, mask, positions = left_padded_batch(model.config.vocab_size)
    expected = hf_logits(peft_model, tokens, mask, positions)
    got = ours(lora_model, params, tokens, mask)
    valid = mask.astype(bool)
    assert np.abs(got[valid] - ours(model, base, tokens, mask)[valid]).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-5, rtol=1e-5)
    # And merged into full weights, a checkpoint transformers loads without peft.
    models.save_pretrained(tmp_path / "merged", lora_model, params)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(merged, tokens, mask, positions)[valid], expected[valid], atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_an_adapter_made_by_peft_loads_here_with_its_logits(case, tmp_path):
    family, lora_config = CASES[case]
    hf_base = tiny_hf_model(family)
    hf_base.save_pretrained(tmp_path / "base")
    peft_config = peft.LoraConfig(
        r=lora_config.rank,
        lora_alpha=lora_config.alpha,
        target_modules=list(lora_config.targets),
        use_rslora=lora_config.rslora,
        init_lora_weights=False,  # random B too: a trained adapter, not the identity
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(hf_base, peft_config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    model, base = models.from_pretrained(tmp_path / "base")
    lora_model, adapters = lora.load_adapter(tmp_path / "adapter", model)
    assert lora_model.config.lora == lora_config
    tokens, mask, positions = left_padded_batch(model.config.vocab_size)
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        ours(lora_model, lora.combine(base, adapters), tokens, mask)[valid],
        hf_logits(peft_model, tokens, mask, positions)[valid],
        atol=1e-5,
        rtol=1e-5,
    )


def test_what_the_adapter_format_cannot_hold_is_refused(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path / "base")
    model, base = models.from_pretrained(tmp_path / "base")
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=2, targets="q_proj"), jax.random.key(0))
    lora.save_adapter(tmp_path / "adapter", lora_model, adapters)
    config_file = tmp_path / "adapter" / lora.ADAPTER_CONFIG
    written = json.loads(config_file.read_text())
    for change, message in [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "lm_head"]}, "targets"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
        ({"use_qalora": True}, "use_qalora"),
        ({"init_lora_weights": "pissa_niter_4"}, "pairs the adapter with a base PEFT changed"),
        ({"future_variant": {"on": True}}, r"unknown key\(s\) \['future_variant'\]"),
        ({"use_rslora": "false"}, "use_rslora must be true or false; got 'false'"),
        ({"r": 2.0}, "r must be an integer > 0"),
        ({"r": True}, "r must be an integer > 0"),
        ({"lora_alpha": "16"}, "lora_alpha must be a finite number"),
        ({"lora_dropout": 1.5}, r"lora_dropout must be a number in \[0, 1\)"),
        ({"target_modules": [3]}, "target_modules must be"),
    ]:
        config_file.write_text(json.dumps({**written, **change}))
        with pytest.raises(ValueError, match=message):
            lora.load_adapter(tmp_path / "adapter", model)
    config_file.write_text(json.dumps({**written, "future_option": None, "qalora_group_size": 32}))  # off: fine
    lora.load_adapter(tmp_path / "adapter", model)
    weights = tmp_path / "adapter" / lora.ADAPTER_WEIGHTS
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=f"{weights} cannot be read"):
        lora.load_adapter(tmp_path / "adapter", model)
    weights.write_bytes(whole)
    config_file.write_text(json.dumps({**written, "r": 3}))  # the tensors are rank 2
    with pytest.raises(ValueError, match="has shape"):
        lora.load_adapter(tmp_path / "adapter", model)
    config_file.write_text(json.dumps({**written, "target_modules": ["q_proj", "k_proj"]}))
    with pytest.raises(ValueError, match="missing"):
        lora.load_adapter(tmp_path / "adapter", model)
    config_file.unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load_adapter(tmp_path / "adapter", model)
    with pytest.raises(ValueError, match="has adapters already"):
        lora.load_adapter(tmp_path / "adapter", lora_model)
    with pytest.raises(ValueError, match="no adapters"):
        lora.save_adapter(tmp_path / "other", model, base)
