"""Small LLaMA-architecture models and batches for optimizer tests."""

from __future__ import annotations

import copy

import torch


def tiny_llama(dtype=torch.float32, seed=0, tie_word_embeddings=False, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
        **overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.train()
    return model


def batch(step, vocab=96, batch_size=2, seq=12):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def clone(model):
    return copy.deepcopy(model)


def max_rel_diff(a, b):
    """Max over parameters of max|a - b| / max|b| (per-tensor relative difference)."""
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        scale = pb.detach().double().abs().max().clamp_min(1e-12)
        worst = max(
            worst, ((pa.detach().double() - pb.detach().double()).abs().max() / scale).item()
        )
    return worst


def max_abs_diff(a, b):
    return max(
        (pa.detach().double() - pb.detach().double()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )
