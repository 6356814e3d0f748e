"""The training side: losses, advantages, HF<->Megatron model families and the Megatron actor."""
