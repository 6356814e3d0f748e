"""relax: colocated RL post-training. A Megatron-core actor and an in-process SGLang engine share devices."""

__version__ = "0.1.0"
