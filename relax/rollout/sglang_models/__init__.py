"""SGLang's model classes of the families relax trains, for SGLang's model registry in relax's engines.

SGLang's registry imports all of its model modules (about 280) in every scheduler process it starts, about 2
CPU-seconds each start, unless SGLANG_EXTERNAL_MODEL_PACKAGE names a package of models: it then imports that
package's modules (relax_families.py here, which imports the modules of SGLANG_MODULES only) and SGLang's own only
when asked for an architecture not among them. relax.rollout.engine names this package unless the variable is set
(a user's own model package then comes first instead, and relax's families load with SGLang's). The model classes
are SGLang's own either way: only when they are imported changes."""

# SGLang's module (sglang.srt.models.<module>) of each architecture relax trains: every Family's text checkpoint
# class and its vision-language checkpoint class (relax.hf_checkpoint.architecture.FAMILIES); SGLang names its
# classes as HF does.
SGLANG_MODULES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
}
