"""mrv2 plugin entry point of gpt-oss: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``GptOssForCausalLM`` (gpt-oss-20b, gpt-oss-120b); it uses the core's default
    decoder-only ModelState."""
    register("GptOssForCausalLM", "mrv2_gpt_oss.model:GptOssForCausalLM")
