"""Build tiny random-weight hybrid models beside the tiny Llama, sharing its tokenizer (no hub access needed).

usage: make_tiny_hybrids.py CACHE_DIR   (CACHE_DIR holds tiny-llama; writes tiny-gemma3, tiny-gemma4,
                                        tiny-granite-hybrid, tiny-qwen3-next, tiny-llama4 and tiny-jamba, each with a
                                        .complete marker)

They exercise vLLM's hybrid KV-cache groups on the real CPU server, for the planner's tests:

* tiny-gemma3: Gemma 3 text model, 5 layers (3 sliding-window of 64 tokens, 2 full attention), 2 KV heads x 32, bf16.
  vLLM groups them in 3 groups of 2 layers, one of them padded.
* tiny-gemma4: Gemma 4 text model, 5 layers (2 sliding-window of 64 tokens with 2 KV heads x 32; 3 full attention
  with 2 KV heads x 64, global_head_dim, transformers making the last layer full), bf16: pages of two sizes, which
  vLLM unifies by giving the sliding layers blocks twice as long.
* tiny-granite-hybrid: Granite-4.0-H shape, 4 layers (3 Mamba-2, 1 attention), 2 KV heads x 32, bf16, Mamba-2
  state: 8 heads x 32 x 16 (SSM) and a 4-tap conv over 256 + 2 x 16 channels. vLLM pads the Mamba page to the
  attention page.
* tiny-qwen3-next: Qwen3-Next shape, 4 layers (3 Gated DeltaNet, 1 attention), 2 KV heads x 32, bf16, a tiny MoE;
  GDN state: 2 key / 4 value heads of 32, 4-tap conv.
* tiny-llama4: Llama 4 text model, 4 layers (3 chunked local attention of 256 tokens, 1 global NoPE layer), 2 KV
  heads x 32, bf16, a tiny MoE every other layer. The chunk is a multiple of the CPU backend's 128-token block, which
  its chunked attention requires.
* tiny-jamba: Jamba shape, 4 layers (3 Mamba-1, layer 3 attention), 2 KV heads x 32, bf16, Mamba-1 state: 256 inner
  channels x 16 (SSM) and a 4-tap conv. vLLM's CPU wheel has no Mamba-1 kernel (selective_scan_fwd): it starts and
  sizes its cache, which is what the planner's test reads, but cannot serve a request.
"""

import json
import os
import shutil
import sys

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

cache = sys.argv[1]
src = os.path.join(cache, "tiny-llama")
with open(os.path.join(src, "config.json")) as f:
    base = json.load(f)
tokens = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
attention = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def save(name: str, model: torch.nn.Module) -> None:
    out = os.path.join(cache, name)
    os.makedirs(out, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(os.path.join(src, f), out)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    open(os.path.join(out, ".complete"), "w").close()
    print("tiny model written to", out)


torch.manual_seed(0)
gemma = Gemma3TextConfig(
    **tokens,
    **attention,
    head_dim=32,
    num_hidden_layers=5,
    sliding_window=64,
    max_position_embeddings=4096,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"],
)
save("tiny-gemma3", Gemma3ForCausalLM(gemma))
gemma4 = Gemma4TextConfig(
    **tokens,
    **attention,
    head_dim=32,
    global_head_dim=64,
    num_hidden_layers=5,
    sliding_window=64,
    max_position_embeddings=4096,
    vocab_size_per_layer_input=tokens["vocab_size"],
    hidden_size_per_layer_input=0,  # no per-layer embeddings
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention", "full_attention"],
)
save("tiny-gemma4", Gemma4ForCausalLM(gemma4))
granite = GraniteMoeHybridConfig(
    **tokens,
    **attention,
    shared_intermediate_size=256,
    num_hidden_layers=4,
    max_position_embeddings=4096,
    num_local_experts=0,
    num_experts_per_tok=0,
    layer_types=["mamba", "mamba", "mamba", "attention"],
    mamba_n_heads=8,
    mamba_d_head=32,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    position_embedding_type="nope",
)
save("tiny-granite-hybrid", GraniteMoeHybridForCausalLM(granite))
qwen3_next = Qwen3NextConfig(
    **tokens,
    **attention,
    head_dim=32,
    num_hidden_layers=4,
    max_position_embeddings=4096,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)
save("tiny-qwen3-next", Qwen3NextForCausalLM(qwen3_next))
llama4 = Llama4TextConfig(
    **tokens,
    **attention,
    intermediate_size_mlp=256,
    head_dim=32,
    num_hidden_layers=4,
    max_position_embeddings=4096,
    num_local_experts=2,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=256,
    no_rope_layers=[1, 1, 1, 0],
)
save("tiny-llama4", Llama4ForCausalLM(llama4))
jamba = JambaConfig(
    **tokens,
    **attention,
    num_hidden_layers=4,
    attn_layer_period=4,
    attn_layer_offset=3,
    num_experts=2,
    num_experts_per_tok=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=8,
    max_position_embeddings=4096,
)
save("tiny-jamba", JambaForCausalLM(jamba))
