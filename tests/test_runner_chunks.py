"""ModelRunner.chunks: which rows get logits and the positions it reports, against transformers'
one-shot logits of the same tokens (an expectation that is not the runner's own); the length limits
at their edges, and when decode steps replay CUDA graphs."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.test_model_vs_transformers import LOGITS_TOL
from tests.tiny_models import make_tiny
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.errors import UserError
from tileinfer.engine.runner import ModelRunner, uses_cuda_graph
from tileinfer.models import Transformer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    hf = make_tiny("qwen2", folder)
    ck = load_checkpoint(folder)
    ids = torch.randint(0, 96, (70,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    return Transformer.from_state_dict(ck.config, ck.state_dict, dtype=torch.float32), ids, want


@pytest.mark.parametrize("logits_from", [None, 0, 1, 15, 16, 17, 40, 69, 70, 200])
def test_chunks_score_the_rows_from_logits_from(tiny, logits_from):
    """Chunks of 16: each yielded (position, logits) block starts at the position it names, the
    blocks cover exactly positions max(logits_from, 0)..69 (only 69 for None), each row equals
    transformers' logits of that position. Catches a ``skip`` or ``row_pos`` off by one, a chunk edge
    dropped or scored twice, the last-row rule for None."""
    model, ids, want = tiny
    runner = ModelRunner(model, page_size=8, prefill_chunk=16, max_seq_len=128)
    got = list(runner.chunks(runner.new_sequence(), ids, logits_from=logits_from))
    covered = [p for pos, lg in got for p in range(pos, pos + lg.shape[0])]
    first = 69 if logits_from is None else min(logits_from, 70)
    assert covered == list(range(first, 70))
    for pos, lg in got:
        rel = ((lg - want[pos : pos + lg.shape[0]]).abs().max() / want.abs().max()).item()
        assert rel < LOGITS_TOL, (pos, rel)


def test_a_sequence_may_fill_its_limits_exactly(tiny, monkeypatch):
    """check_length counts the tokens already in the sequence plus the new ones: up to the runner's
    ``max_seq_len`` (80 here) and the model's sliding window (75 here) they fit, one more is refused
    with a UserError naming the limit. Catches a strict comparison, the new tokens subtracted."""
    model, ids, _ = tiny
    runner = ModelRunner(model, page_size=8, prefill_chunk=16, max_seq_len=80)
    seq = runner.new_sequence()
    list(runner.chunks(seq, ids))  # 70 tokens
    runner.check_length(seq, 10)
    with pytest.raises(UserError, match="sequence of 81 tokens exceeds the runner's limit of 80"):
        runner.check_length(seq, 11)
    with pytest.raises(UserError, match="sequence of 81 tokens"):
        list(runner.chunks(seq, ids[:11]))
    monkeypatch.setattr(model, "config", replace(model.config, sliding_window=75))
    runner.check_length(seq, 5)
    with pytest.raises(UserError, match="sequence of 76 tokens exceeds the model's sliding window of 75"):
        runner.check_length(seq, 6)


def test_the_cache_is_in_the_models_dtype(tmp_path):
    """A BF16 model gets a BF16 KV cache (a float32 one would change every attention result), INT8
    codes with float32 scales when asked."""
    make_tiny("qwen2", tmp_path)
    ck = load_checkpoint(tmp_path)
    bf16 = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=torch.bfloat16)
    assert ModelRunner(bf16, max_seq_len=64).kv.k.dtype == torch.bfloat16
    int8 = ModelRunner(bf16, kv_int8=True, max_seq_len=64).kv
    assert int8.k.dtype == torch.int8 and int8.layers[0].k_scale.dtype == torch.float32


def test_the_runners_context_defaults_to_the_models_and_may_not_exceed_it(tiny):
    model, _, _ = tiny
    ctx = model.config.max_position_embeddings  # 256 in the tiny models
    assert ModelRunner(model).max_seq_len == ctx and ModelRunner(model, max_seq_len=ctx).max_pages == -(-ctx // 64)
    with pytest.raises(UserError, match=f"{ctx + 1} positions exceed the model's context of {ctx}"):
        ModelRunner(model, max_seq_len=ctx + 1)


def test_cuda_graphs_only_when_requested_on_cuda_with_a_capturable_backend(tiny):
    """Decode steps replay CUDA graphs only when asked, on a CUDA device, with a backend that says
    it is capturable (``Backend.cuda_graphs``); the CPU runner never does, even when asked."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capturable, other = SimpleNamespace(cuda_graphs=True), SimpleNamespace()
    assert uses_cuda_graph(True, cuda, capturable) is True
    assert not uses_cuda_graph(False, cuda, capturable)
    assert not uses_cuda_graph(True, cpu, capturable)
    assert not uses_cuda_graph(True, cuda, other)
    assert not uses_cuda_graph(True, cuda, SimpleNamespace(cuda_graphs=False))
    assert ModelRunner(tiny[0], cuda_graph=True, max_seq_len=80).cuda_graph is False
