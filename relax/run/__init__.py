"""The run: the colocated loop (loop) and the one on separate devices (loop_async, --no-colocate), checkpoints,
resume and signals (state), and its record (metrics)."""
