"""Attention backends over paged KV."""
