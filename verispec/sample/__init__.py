"""Sampler (logits processing + sampling) and the rejection sampler."""

from verispec.sample.rejection_sampler import RejectionSampler
from verispec.sample.sampler import Sampler, SamplingTensors

__all__ = ["RejectionSampler", "Sampler", "SamplingTensors"]
