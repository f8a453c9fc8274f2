"""Build a tiny random-weight Llama and a locally trained BPE tokenizer (no hub access needed).

usage: make_tiny_model.py OUT_DIR [--wide]

2 layers, 4 attention heads, 2 KV heads, hidden 128 (head_dim 32), bf16: one token of KV cache costs
2 (K and V) x 2 layers x 2 KV heads x 32 x 2 bytes = 512 bytes.

--wide: 6 layers, 24 heads, 8 KV heads, hidden 1,536 (head_dim 64), MLP 6,144: 200 M parameters (400 MB), for the
latency test. The tiny model's inter-token latency (~9 ms) lies inside vLLM's first histogram bucket (10 ms) at any
load on 2 cores, so a quantile read from it is interpolation noise; so did a 52 M-parameter one's at one stream. This
one's rises through several buckets as streams are added (its weights are read, and its matmuls grow, at each step).
"""

import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
wide = sys.argv[2:] == ["--wide"]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
words = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "monitoring",
    "sidecar",
    "metrics",
    "latency",
    "throughput",
    "request",
    "token",
    "cache",
    "memory",
    "server",
    "model",
    "queue",
    "hello",
    "world",
]
corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(2000)]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(
    corpus,
    trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    ),
)
hf_tok = PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=2048
)
# A minimal chat template so that /v1/chat/completions works too.
hf_tok.chat_template = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
hf_tok.save_pretrained(out)
shape = (
    dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=6, num_attention_heads=24, num_key_value_heads=8)
    if wide
    else dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
)
cfg = LlamaConfig(
    vocab_size=tok.get_vocab_size(),
    **shape,
    max_position_embeddings=2048,
    bos_token_id=hf_tok.bos_token_id,
    eos_token_id=hf_tok.eos_token_id,
    pad_token_id=hf_tok.pad_token_id,
    tie_word_embeddings=False,
)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
GenerationConfig(
    bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
).save_pretrained(out)
print("tiny model written to", out, "vocab", cfg.vocab_size)
