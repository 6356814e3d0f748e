"""A contract double of MindSpeed (Ascend/MindSpeed at relax.pins.MINDSPEED, branch core_r0.16.0), for tests only.

On PYTHONPATH (a subprocess or a Ray actor) it imports as `mindspeed` and does to megatron-core what the real package
does at that commit where relax meets it, with no NPU and none of MindSpeed's kernels:

- `mindspeed.megatron_adaptor` imports torch_npu's transfer_to_npu, reads the feature arguments from sys.argv and
  patches megatron-core at import; `repatch(args)` copies arguments onto MindSpeed's arguments and patches again
  (megatron_adaptor.py);
- every TransformerConfig becomes an instance of a generated subclass carrying each MindSpeed argument as an extra
  field with init=False and no default (core/megatron_basic/arguments_basic.py, transformer_config_init_wrapper);
- every config is validated at `__post_init__` by each feature's checks, which read those fields
  (arguments_basic.py, transformer_config_post_init_wrapper; the checks in features_manager/).
- `mindspeed.core.context_parallel.ring_context_parallel.ring_context_parallel.ringattn_context_parallel` takes the
  arguments of its causal eod-reset (TND) mode and returns that attention (core/context_parallel/).

Each module cites the upstream file of each behaviour. No upstream code is copied: these are relax's own
implementations of the observable behaviour. The features modelled are those relax switches on and those whose checks
read what relax's configs must carry (features.py)."""
