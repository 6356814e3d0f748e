"""Stand-in of torch_npu.contrib: only transfer_to_npu, which SGLang imports when it initialises its NPU backend."""
