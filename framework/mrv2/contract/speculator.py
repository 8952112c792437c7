"""The speculator interface: propose draft tokens on the device after each sampling step.

Flow of one decode step of ``1 + k`` tokens for a request (DESIGN.md section 6): the step's
tokens are the last sampled token and the ``k`` drafts proposed after the previous step; the
sampler draws the target's own token at each of the ``1 + k`` positions (noise keyed by request
seed and position, as without speculation); :func:`mrv2.sample.rejection.strict_rejection`
keeps the drafts up to the first one the target disagrees with and adds the target's token
there (the bonus); the post-update writes accepted + bonus tokens into the state table and
moves ``num_computed`` past the accepted ones only (rejected drafts' KV is overwritten later);
then :meth:`Speculator.propose` writes the next ``k`` drafts. Nothing of this reads the device
on the host: the CPU schedules ``1 + k`` tokens per decode request and learns how many were
accepted one step late, with the sampled tokens.

Drafts live in the state table's ``token_ids`` row right after the request's known tokens
(positions ``num_tokens .. num_tokens + k - 1``), which the prep kernel reads as the step's
input tokens like any other; verified positions are overwritten by the post-update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from mrv2.config import EngineConfig
from mrv2.contract.batch import InputBatch
from mrv2.contract.kv_cache import KVCacheSpec
from mrv2.contract.model_state import ModelState
from mrv2.contract.samples import SpeculatorInputs, StepSamples
from mrv2.contract.state_table import RequestStateTable

__all__ = ["Speculator", "SpeculatorInputs", "StepSamples"]


class Speculator(ABC):
    """Proposes ``num_speculative_tokens`` drafts per request, on the device, after sampling.

    Built once per runner as ``cls(config, model_state, device)`` (registered through
    ``mrv2_register_speculators``). :meth:`propose` runs after every step's post-update, for
    the requests that sampled; it launches device work only (no ``.item()``, ``.tolist()``,
    ``.cpu()``), and must write drafts for every such request: the scheduler always schedules
    ``1 + k`` tokens for a decode request, and a draft the target rejects costs only compute.
    """

    def __init__(self, config: EngineConfig, model_state: ModelState,
                 device: torch.device) -> None:
        self.config = config
        self.model_state = model_state
        self.device = device
        self.num_speculative_tokens = config.speculative.num_speculative_tokens
        self.kv_caches: Sequence[torch.Tensor] = ()
        self.kv_backends: Sequence[Any] = ()
        self.sampling: Any = None
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative method {config.speculative.method!r} needs "
                f"num_speculative_tokens >= 1, got {self.num_speculative_tokens}"
            )

    #: Whether :meth:`propose` reads ``inputs.hidden_states`` (lets the runner skip them).
    needs_hidden_states: bool = False
    #: Whether :meth:`propose` can be captured in a CUDA graph: device work only, shapes from
    #: ``batch.num_reqs`` / ``batch.num_tokens_padded`` only, nothing kept from one call to the
    #: next, and writes only where the request sampled (in a graph ``batch`` is the padded
    #: batch: its padding requests have ``num_sampled == 0`` and stale, possibly live, rows;
    #: :meth:`mrv2.spec_decode.drafting.DraftSteps.write` masks them). The runner then replays
    #: one graph per padded decode size for all of a step's drafting.
    cuda_graphs: bool = False
    #: KV slots past each step's last token that :meth:`propose` writes (a drafter with a cache
    #: of its own runs ahead of the target by up to ``k`` positions); the scheduler reserves
    #: them.
    num_lookahead_tokens: int = 0

    def build(self, registries: Any) -> None:
        """Called once after construction, with the plugin registries (a drafter that is a
        registered model loads it here). Nothing by default."""
        return None

    def bind_sampling(self, sampling: Any) -> None:
        """The sampler's per-request columns (``seed``, ``temperature``... by state-table row;
        None for a plugin sampler without them), so drafts can be drawn with the target's
        noise. Called once, when the runner is built."""
        self.sampling = sampling

    def kv_cache_specs(self, first_layer_idx: int) -> dict[int, KVCacheSpec]:
        """The drafter's own cache layers (Eagle heads, MTP layers, a draft model), numbered
        from ``first_layer_idx`` on, after the target's; none by default. Called once, before
        the KV cache is sized: they share the target's block ids and block budget."""
        return {}

    def bind_kv_caches(self, kv_caches: Sequence[torch.Tensor], backends: Sequence[Any]) -> None:
        """The allocated cache tensor and backend of every layer, by ``layer_idx`` (the target's
        and this drafter's). Called once, after allocation; the drafter runs its cache layers
        under its own :class:`~mrv2.contract.forward_context.ForwardContext` over them."""
        self.kv_caches = kv_caches
        self.kv_backends = backends

    @abstractmethod
    def propose(
        self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
        table: RequestStateTable,
    ) -> None:
        """Write ``k`` drafts for each request with ``samples.num_sampled > 0`` into
        ``table.token_ids[row, table.num_tokens[row] : + k]`` (``row = batch.idx_mapping[i]``;
        ``num_tokens`` is already updated for this step)."""
