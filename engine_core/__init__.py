"""The engine-core process: scheduler, paged KV cache, model runner, sampler, busy loop."""
