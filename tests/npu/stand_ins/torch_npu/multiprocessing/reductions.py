"""Stand-in of torch_npu.multiprocessing.reductions: the rebuild function SGLang wraps (utils/patch_torch.py)."""

from torch_npu import _needs_device

rebuild_npu_tensor = _needs_device("multiprocessing.reductions.rebuild_npu_tensor")
