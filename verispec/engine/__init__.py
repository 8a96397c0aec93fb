"""Engine: LLM, scheduler, model runner, KV cache, metrics."""
