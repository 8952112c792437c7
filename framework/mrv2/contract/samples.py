"""What a step produced (tokens per request) and what the target model hands its speculator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepSamples:
    """A step's output tokens per request, on the device."""

    tokens: torch.Tensor
    """``[num_reqs, 1 + max drafts]`` int64: accepted drafts then the bonus token; ``-1`` after."""
    num_sampled: torch.Tensor
    """``[num_reqs]`` int32: tokens in each row (0: the request sampled nothing this step)."""


@dataclass
class SpeculatorInputs:
    """What the target model hands its speculator after a step (``ModelState`` builds it)."""

    hidden_states: torch.Tensor | None
    """``[num_tokens, hidden]`` last-layer hidden states of the step's tokens (MTP, Eagle)."""
    aux_hidden_states: torch.Tensor | None = None
    """``[num_tokens, n * hidden]``: the residual stream at the input of ``n`` chosen layers,
    side by side (Eagle3), if the model keeps them (``DecoderModel.keep_aux_hidden_states``):
    a view of a persistent buffer, valid until the next forward."""
