"""The double's `mindspeed.core`: only the context-parallel attention relax calls (context_parallel/)."""
