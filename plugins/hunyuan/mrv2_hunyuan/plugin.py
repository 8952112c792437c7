"""mrv2 plugin entry point of the Hunyuan family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``HunYuanDenseV1ForCausalLM`` (Hunyuan 0.5B / 1.8B / 4B / 7B) and
    ``HunYuanMoEV1ForCausalLM`` (Hunyuan-A13B); they use the core's default decoder-only
    ModelState."""
    register("HunYuanDenseV1ForCausalLM", "mrv2_hunyuan.model:HunYuanDenseV1ForCausalLM")
    register("HunYuanMoEV1ForCausalLM", "mrv2_hunyuan.model:HunYuanMoEV1ForCausalLM")
