"""``python -m benchmarks.peers`` end to end on the GPU at a small shape: qwen3-0.6b-random, one
short context, every peer (torchao's row may say it was skipped), and the table saved."""

import pyarrow.parquet as pq
import pytest
import torch

from benchmarks.peers.bench import main

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_peers_benchmark_runs(tmp_path):
    argv = ["--models", "qwen3-0.6b-random", "--contexts", "256", "--steps", "8", "--warmup", "4"]
    assert main(argv + ["--out", str(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / "peers.parquet").to_pylist()
    got = {(r["quant"], r["peer"]): r for r in rows}
    assert set(got) == {
        ("bf16", "tileinfer-triton"),
        ("bf16", "gptfast"),
        ("bf16", "hf_eager"),
        ("bf16", "hf_static"),
        ("int8_weights", "tileinfer-triton"),
        ("int8_weights", "gptfast"),
        ("int8_weights", "torchao"),
    }
    for (quant, peer), r in got.items():
        if peer != "torchao" or not r["error"].startswith("skipped"):
            assert r["error"] == "" and r["tok_s"] > 0, (quant, peer, r["error"])
    assert got[("bf16", "tileinfer-triton")]["ours_vs_best_peer"] > 0
