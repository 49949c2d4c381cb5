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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
