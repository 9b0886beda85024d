"""Decoder-only model families (Llama, Qwen2, Mistral) and their weight loader."""
