"""The engine on a real GGUF gives the logits transformers gives on the same file (float32)."""

import torch
import transformers

from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.tokenizer import Tokenizer
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer


def test_smollm2_gguf_logits_match_transformers(smollm2_gguf):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    tok = Tokenizer.load(smollm2_gguf)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about paged attention."}])
    ids = torch.tensor(tok.encode(text) + tok.encode("Pages of memory"))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    ck = load_checkpoint(smollm2_gguf, dtype=torch.float32)
    model = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=torch.float32)
    runner = ModelRunner(model, page_size=16, prefill_chunk=24, max_seq_len=256)
    seq = runner.new_sequence()
    got = torch.cat([lg for _, lg in runner.chunks(seq, ids, logits_from=0)])
    # float32 both sides, 30 layers: measured 1.9e-6 (2026-12-01); a misplaced RMSNorm eps gives ~1e-4
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
