"""Write a random-weight Qwen3-MoE with SmolLM2-135M's shape, or (--experts 0) the dense
Qwen3 with the same active FLOPs per token, for timing the mixture-of-experts path.

    python benchmarks/make_random_moe_model.py /tmp/moe-8x2
    python benchmarks/make_random_moe_model.py /tmp/moe-dense --experts 0
    python benchmarks/throughput.py --model /tmp/moe-8x2 ...

Both have SmolLM2's hidden size (576), 30 layers (--layers), vocabulary and tokenizer, and 8
attention heads of 72 dims with 4 KV heads (as make_random_model.py). The MoE model routes each
token to --top-k of --experts experts of width 1536 / top_k, so a token's expert FLOPs equal the
dense model's MLP of width 1536; the MoE model holds experts / top_k times the MLP weights.
The outputs are noise: only speed is measured (throughput.py sets ignore_eos).
"""
import argparse
import os
import sys

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, \
    Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedlm.model_executor.model_loader.model_path import resolve_model  # noqa: E402

DENSE_MLP = 1536


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--experts", type=int, default=8, help="0: the dense Qwen3 equivalent")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=30, help="fewer for a quicker run")
    args = p.parse_args()
    if args.experts and (not 1 <= args.top_k <= args.experts or DENSE_MLP % args.top_k):
        p.error(f"--top-k must be in 1..--experts and divide {DENSE_MLP}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    shape = dict(vocab_size=len(tokenizer), hidden_size=576, num_hidden_layers=args.layers,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=72,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 rope_theta=100000, bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if args.experts:
        config = Qwen3MoeConfig(**shape, num_experts=args.experts,
                                num_experts_per_tok=args.top_k,
                                moe_intermediate_size=DENSE_MLP // args.top_k,
                                intermediate_size=DENSE_MLP, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=DENSE_MLP))
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
