"""A minimal torch_npu stand-in for the MindSpeed double: the modules the double and relax's NPU platform import
(torch_npu, torch_npu.contrib.transfer_to_npu). Importing it changes nothing on the CPU."""
