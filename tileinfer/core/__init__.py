"""Core: plain data beneath every layer: model config, paged KV cache, checkpoint readers, model
fetching, tokenizer and the user-error type. Imports nothing else of tileinfer."""
