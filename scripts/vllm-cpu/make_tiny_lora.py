"""Build a tiny random-weight LoRA adapter for the tiny Llama, in PEFT's layout (no hub access, no peft needed).

usage: make_tiny_lora.py CACHE_DIR   (CACHE_DIR holds tiny-llama; writes tiny-llama-lora with a .complete marker)

Rank 8 on q_proj and v_proj of both layers: ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's
tensor names (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``, A of rank x in, B of out x rank).
The tests serve it under several names (``--lora-modules a=... b=...``) so that vLLM's LoRA slots
(``--max-loras``) fill and its ``vllm:lora_requests_info`` shows adapters running and waiting.
"""

import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file

RANK = 8
cache = sys.argv[1]
with open(os.path.join(cache, "tiny-llama", "config.json")) as f:
    base = json.load(f)
hidden, head_dim = base["hidden_size"], base["head_dim"]
outputs = {"q_proj": base["num_attention_heads"] * head_dim, "v_proj": base["num_key_value_heads"] * head_dim}
generator = torch.Generator().manual_seed(0)
tensors = {}
for layer in range(base["num_hidden_layers"]):
    for module, out in outputs.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=generator, dtype=torch.bfloat16) * 0.01
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, RANK, generator=generator, dtype=torch.bfloat16) * 0.01
config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": os.path.join(cache, "tiny-llama"),
    "r": RANK,
    "lora_alpha": 2 * RANK,
    "lora_dropout": 0.0,
    "bias": "none",
    "target_modules": sorted(outputs),
    "fan_in_fan_out": False,
    "inference_mode": True,
}
out_dir = os.path.join(cache, "tiny-llama-lora")
tmp = tempfile.mkdtemp(dir=cache)
save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"))
with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
open(os.path.join(tmp, ".complete"), "w").close()
shutil.rmtree(out_dir, ignore_errors=True)
os.rename(tmp, out_dir)
print(f"wrote {out_dir}", file=sys.stderr)
