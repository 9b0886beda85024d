"""Decoder-only model families (Llama, Qwen2, Qwen3, Mistral, Phi-3; the mixtures of experts
Mixtral, Qwen2-MoE, Qwen3-MoE) and their weight loader."""
