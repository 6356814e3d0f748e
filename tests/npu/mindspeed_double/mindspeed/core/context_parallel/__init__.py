"""The double's `mindspeed.core.context_parallel`: the ring attention relax calls (ring_context_parallel/)."""
