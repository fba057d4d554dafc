"""Engine: the model runner (paged KV cache, chunked prefill, decode steps, CUDA graphs) and greedy
generation on top of it. Calls models, ops and core; knows nothing of jobs, evals or quantize."""
