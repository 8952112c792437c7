"""Sampling: parameters and the sampler pipeline."""

from mrv2.contract.params import SamplingParams

__all__ = ["SamplingParams"]
