"""Weight sync: Megatron weights under HF names (export.py), packed into SGLang flattened buckets (bucket.py)."""
