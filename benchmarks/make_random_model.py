"""Write a random-weight Llama with SmolLM2-135M's shape but an even head count, for timing
tensor parallelism at TP=2 (SmolLM2 itself has 9 heads and 3 KV heads: TP 1, 3 or 9 only).

    python benchmarks/make_random_model.py /tmp/smollm2-shaped-8h
    python benchmarks/throughput.py --model /tmp/smollm2-shaped-8h -tp 2 --baseline tp1 ...

Same hidden size (576), MLP width (1536), 30 layers, vocabulary and tokenizer as SmolLM2; 8
attention heads of 72 dims and 4 KV heads instead of 9 and 3, so the FLOPs per token and the
KV-cache size per token are within a few percent of the real model's. The outputs are noise:
only speed is measured (throughput.py sets ignore_eos).
"""
import argparse
import os
import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedlm.model_executor.model_loader.model_path import resolve_model  # noqa: E402


def write_random_llama(out: str, *, hidden_size: int = 576, intermediate_size: int = 1536,
                       layers: int = 30, heads: int = 8, kv_heads: int = 4,
                       dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    """A random-weight Llama with the default model's tokenizer and vocabulary, saved as
    HF-format safetensors in `dtype` (transformers' own init: normal(0, 0.02) matrices, unit
    norms), with SmolLM2's rope, norm epsilon and tied embeddings."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, rope_theta=100000,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    # Built in `dtype` directly: a 1B model's float32 copy would be 4 GB more at the peak.
    LlamaForCausalLM._from_config(config, dtype=dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    args = p.parse_args()
    write_random_llama(args.out, heads=args.heads, kv_heads=args.kv_heads)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
