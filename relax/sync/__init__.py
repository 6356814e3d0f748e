"""Weight transport: buckets of HF-named tensors (made by relax.train.weight_export) packed into SGLang
flattened buckets (bucket.py), sent to each engine by handle on the sender's node and through a broadcast
group elsewhere (broadcast.py)."""
