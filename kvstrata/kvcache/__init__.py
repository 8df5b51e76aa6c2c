"""KV cache tiers: L1 pages, the prefix caches over them."""
