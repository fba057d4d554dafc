"""Peers to time this engine's decode against: ``python -m benchmarks.peers`` (see :mod:`.bench`).

- :mod:`.gptfast`: a gpt-fast style decoder in plain torch (static KV cache, ``torch.compile``), BF16
  and INT8 weight-only; torchao's INT8 weight-only quantization is applied to it too.
- :mod:`.hf`: transformers' ``generate`` on the same weights, eager and with a static cache.
- :mod:`.bench`: the measurement, the table and the command line.
"""
