"""Stands in for torch_npu's transfer_to_npu, which redirects torch.cuda calls to the NPU at import: nothing to
redirect on the CPU (relax.platform.cpu_megatron redirects megatron-core's CUDA calls there)."""
