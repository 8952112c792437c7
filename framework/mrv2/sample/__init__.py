"""Sampling: parameters and the sampler pipeline."""

from mrv2.sample.params import SamplingParams

__all__ = ["SamplingParams"]
