"""SGLang 0.5.23 on the CPU (filled in by the next change)."""


def prepare_sglang() -> None:
    raise NotImplementedError("SGLang on the CPU platform is not prepared yet")
