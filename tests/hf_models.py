"""Tiny Hugging Face decoder configs shared by the test files: built from configs, nothing downloaded."""

import torch
from torch import nn

# four layers, 32 wide, two heads: the sizes every decoder-only family in the tests is built at
TINY_DECODER: dict[str, int] = dict(
    num_hidden_layers=4,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=32,
)


def tiny_llama(**config: object) -> nn.Module:
    """A four-layer Llama (seed 0) with `TINY_DECODER`'s sizes, its other defaults untouched unless given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, **config}))
