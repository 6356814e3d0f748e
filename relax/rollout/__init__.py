"""Rollout: the in-process SGLang engine, prompt data, sampling, reward functions and group handling."""
