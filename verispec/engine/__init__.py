"""Engine: LLM, scheduler, model runner, KV cache, metrics."""

from verispec.engine.llm import LLM
from verispec.engine.request import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestMetrics", "RequestOutput"]
