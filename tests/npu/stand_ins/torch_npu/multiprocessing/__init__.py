"""Stand-in of torch_npu.multiprocessing: only `reductions`, which SGLang patches to remap device indices."""
