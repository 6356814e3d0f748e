"""Weight sync: Megatron weights under HF names (export.py), packed into SGLang flattened buckets (bucket.py),
sent to each engine by handle on the sender's node and through a broadcast group elsewhere (broadcast.py)."""
