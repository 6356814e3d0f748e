"""Stand-in of torch_npu.contrib.transfer_to_npu. The real module, on import, redirects torch's CUDA entry points
(torch.cuda.*, "cuda" device arguments) to the NPU. Nothing here runs on a device, so the stand-in redirects
nothing: importing it only succeeds, as SGLang's init_npu_backend (hardware_backend/npu/utils.py) needs."""
