"""Who runs the steps: one :class:`~mrv2.runner.runner.Runner` in this process, or, with
``tensor_parallel_size > 1``, rank 0's :class:`~mrv2.executor.tensor_parallel.DistributedRunner`
and its workers. :func:`make_runner` picks; :class:`~mrv2.engine.engine.LLMEngine` calls it."""

from __future__ import annotations

import os

from mrv2.config import EngineConfig
from mrv2.plugins import PluginManager, get_plugin_manager
from mrv2.runner.runner import Runner


def make_runner(config: EngineConfig, plugins: PluginManager | None = None) -> Runner:
    """The runner for ``config``: a plain :class:`Runner` for one device, else rank 0's
    :class:`~mrv2.executor.tensor_parallel.DistributedRunner` (under ``torchrun``, on the other
    ranks, this call serves as a worker and exits the process when rank 0 stops)."""
    if config.parallel.tensor_parallel_size == 1:
        return Runner.from_config(config, plugins)
    from mrv2.executor.tensor_parallel import DistributedRunner, launched_by_torchrun
    from mrv2.executor.worker import run_torchrun_worker

    if plugins is None and not launched_by_torchrun():
        in_code = [info.name for info in get_plugin_manager().list_plugins()
                   if info.source == "registered by code"]
        if in_code:  # (the spawned workers would not have them)
            raise ValueError(
                f"tensor_parallel_size > 1 starts workers that load plugins from their entry "
                f"points only; plugins registered in code ({', '.join(map(repr, in_code))}) "
                "are not there: install them as a package with an entry point in group 'mrv2' "
                "(or launch every rank with torchrun)")
    model_dir = Runner.resolve_model_dir(config)
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        run_torchrun_worker(config, model_dir)
    if plugins is not None:
        raise ValueError("tensor_parallel_size > 1 loads plugins in every rank's process from "
                         "their entry points: install the plugin instead of passing plugins=")
    return DistributedRunner(config, model_dir)
