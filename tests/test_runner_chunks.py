"""ModelRunner.chunks: which rows get logits and the positions it reports, against transformers'
one-shot logits of the same tokens (an expectation that is not the runner's own)."""

import pytest
import torch

from tests.test_model_vs_transformers import LOGITS_TOL
from tests.tiny_models import make_tiny
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.engine.runner import ModelRunner
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
