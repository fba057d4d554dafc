"""Jobs: one evaluation job (candidate vs base configuration, scored over prompt sets), its drift
metrics and the rows it writes. Called by the commands; calls the engine, ``quantize`` and ``evals``."""
