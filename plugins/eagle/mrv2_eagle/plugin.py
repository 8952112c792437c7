"""mrv2 plugin entry point of EAGLE speculation: registers the ``eagle`` and ``eagle3``
speculators, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_speculators(register: Callable[..., None]) -> None:
    """``speculative_config={"method": "eagle" | "eagle3", "model": HEAD_DIR,
    "num_speculative_tokens": k}``."""
    register("eagle", "mrv2_eagle.speculator:EagleSpeculator")
    register("eagle3", "mrv2_eagle.speculator:Eagle3Speculator")
