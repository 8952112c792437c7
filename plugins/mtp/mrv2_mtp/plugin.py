"""mrv2 plugin entry point of MTP speculation: registers the ``mtp`` speculator, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_speculators(register: Callable[..., None]) -> None:
    """``speculative_config={"method": "mtp", "num_speculative_tokens": k}``."""
    register("mtp", "mrv2_mtp.speculator:MTPSpeculator")
