"""Build two tiny random-weight speculative-decoding drafters for the tiny Llama, sharing its tokenizer (no hub access).

usage: make_tiny_drafters.py CACHE_DIR   (CACHE_DIR holds tiny-llama and tiny-gemma4; writes tiny-llama-eagle,
                                         tiny-llama-draft, tiny-deepseek-mtp and tiny-gemma4-assistant, each with a
                                         .complete marker)

They exercise how vLLM sizes the KV cache when a drafter's layers share the target's pool, for the planner's tests:

* tiny-llama-eagle: an EAGLE-1 drafter (vLLM's ``EagleLlamaForCausalLM``): 1 decoder layer with the target's
  attention shape (2 KV heads x 32, bf16) and the ``fc`` that joins the token embedding to the target's hidden state.
  Its layer adds one page of the target's size to every block.
* tiny-llama-draft: a separate, smaller draft model (``--speculative-config.method draft_model``): a Llama of 3
  layers with 1 KV head x 32, so its pages are half the target's: vLLM keeps one group of per-layer page sizes.
* tiny-deepseek-mtp: a DeepSeek-V3 of 2 MLA layers (latent 512 + rope 64, the CPU MLA kernel's size, bf16) and one
  multi-token-prediction layer (``num_nextn_predict_layers`` 1) stored as DeepSeek ships it: ``model.layers.2``
  with its ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head`` (``--speculative-config.method mtp``).
* tiny-gemma4-assistant: Gemma 4's assistant for tiny-gemma4 (transformers' ``Gemma4AssistantForCausalLM``, run by
  vLLM as ``method mtp``): 2 Q-only layers (sliding, full) that read the target's K/V, so no page of their own.
"""

import glob
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

cache = sys.argv[1]
src = os.path.join(cache, "tiny-llama")
with open(os.path.join(src, "config.json")) as f:
    base = json.load(f)
keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_size", "intermediate_size")
common = {k: base[k] for k in keep}


def copy_tokenizer(out: str, source: str = src) -> None:
    os.makedirs(out, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(source, f)):
            shutil.copy(os.path.join(source, f), out)


torch.manual_seed(1)
# EAGLE-1: the drafter's weights are named as in vLLM's llama_eagle.py (its loader prefixes "model."): the decoder
# layer without its input norm (EAGLE skips it), the fc over [embedding, hidden state], and its own embedding.
eagle_cfg = LlamaConfig(**common, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip
layer = LlamaForCausalLM(eagle_cfg).to(torch.bfloat16).state_dict()
tensors = {k.removeprefix("model."): v.contiguous() for k, v in layer.items() if k.startswith("model.layers.0.")}
tensors.pop("layers.0.input_layernorm.weight")
tensors["embed_tokens.weight"] = layer["model.embed_tokens.weight"].contiguous()
tensors["fc.weight"] = (torch.randn(base["hidden_size"], 2 * base["hidden_size"]) * 0.02).to(torch.bfloat16)
out = os.path.join(cache, "tiny-llama-eagle")
copy_tokenizer(out)
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
config = eagle_cfg.to_dict()
config.update(architectures=["EagleLlamaForCausalLM"], model_type="llama", dtype="bfloat16")
config.pop("torch_dtype", None)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
open(os.path.join(out, ".complete"), "w").close()
print("tiny drafter written to", out)

draft_cfg = LlamaConfig(**common, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                        max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip
out = os.path.join(cache, "tiny-llama-draft")
copy_tokenizer(out)
LlamaForCausalLM(draft_cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
open(os.path.join(out, ".complete"), "w").close()
print("tiny drafter written to", out)

torch.manual_seed(2)
deepseek = dict(
    **{k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_size")},
    intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    max_position_embeddings=4096, topk_method="noaux_tc",
)  # fmt: skip
# three decoder layers saved in the checkpoint layout; the third becomes the MTP layer's block
model = DeepseekV3ForCausalLM(DeepseekV3Config(**deepseek, num_hidden_layers=3)).to(torch.bfloat16)
with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp, safe_serialization=True)
    tensors = {}
    for f in sorted(glob.glob(os.path.join(tmp, "*.safetensors"))):
        tensors.update(load_file(f))
hidden, mtp = base["hidden_size"], "model.layers.2."
for norm in ("enorm", "hnorm", "shared_head.norm"):
    tensors[mtp + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
tensors[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(torch.bfloat16)
tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
out = os.path.join(cache, "tiny-deepseek-mtp")
copy_tokenizer(out)
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
config = DeepseekV3Config(**deepseek, num_hidden_layers=2, num_nextn_predict_layers=1).to_diff_dict()
config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", dtype="bfloat16")
config.update(num_nextn_predict_layers=1)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
open(os.path.join(out, ".complete"), "w").close()
print("tiny drafter written to", out)

torch.manual_seed(3)
gemma4_dir = os.path.join(cache, "tiny-gemma4")
with open(os.path.join(gemma4_dir, "config.json")) as f:
    gemma4 = json.load(f)
# the assistant's own decoder: narrower than the target (its pre/post projections join the two widths); each layer
# type's head_dim matches the target's layer it reads (32 sliding, 64 full); all layers KV-shared, as
# Gemma4AssistantConfig requires
text = Gemma4TextConfig(
    **{k: gemma4[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters")},
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, layer_types=["sliding_attention", "full_attention"], sliding_window=gemma4["sliding_window"],
    per_layer_config={"1": {"head_dim": 64}}, max_position_embeddings=4096, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0, enable_moe_block=False, use_double_wide_mlp=False, num_kv_shared_layers=2,
)  # fmt: skip
assistant = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=gemma4["hidden_size"])
out = os.path.join(cache, "tiny-gemma4-assistant")
copy_tokenizer(out, gemma4_dir)
Gemma4AssistantForCausalLM(assistant).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
open(os.path.join(out, ".complete"), "w").close()
print("tiny drafter written to", out)
