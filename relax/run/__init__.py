"""The run: the colocated loop (loop), checkpoints, resume and signals (state), and its record (metrics)."""
