"""Llama-family models: config, layers, loading, tokenizer, tiny random models."""
