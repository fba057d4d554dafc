"""Reply drift (``eval=default``): each prompt is followed by the base model's greedy reply, scored.

Both sides read the identical token stream, a prompt of ``ctx`` tokens and the base's greedy reply
of at most ``n_score`` tokens; the candidate runs teacher-forced over it, so its logits at every
reply position compare one to one with the base's (llama.cpp's ``--kl-divergence`` applied to a
model-generated continuation, as TileInfer.jl evaluates). Prompt sets are the built-in chat
prompts of :mod:`evals.prompts` or local ``.txt``/``.jsonl`` files, whose texts are cut to ``ctx``
tokens (BOS first where :func:`evals.evaluation.bos_first` says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from evals.evaluation import Evaluation, Item, ScoredSet, bos_first, unique_names
from evals.prompts import PROMPT_SETS, Tokenizer, build_prompt, build_text_prompt, load_text_prompts
from tileinfer.core.errors import UserError
from tileinfer.core.settings import choice, number


@dataclass
class ReplySettings:
    """``eval=default``: prompt sets, each followed by the base model's greedy reply."""

    name: str = choice("reply", "reply")
    prompt_sets: list[str] = field(default_factory=lambda: ["edit", "explain"])  # built-in names or file paths
    n_score: int = number(1024, 1)  # scored positions: the base model's greedy reply after the prompt
    # BOS before a prompt file's text; null: the tokenizer's add_bos_token (built-in sets follow their chat template)
    add_bos: Optional[bool] = None

    def __post_init__(self):
        if not self.prompt_sets:
            raise UserError("eval.prompt_sets must be a non-empty list, e.g. eval.prompt_sets=[edit,explain]")
        if self.add_bos is not None and all(n in PROMPT_SETS for n in self.prompt_sets):
            raise UserError(
                f"eval.add_bos={str(self.add_bos).lower()} applies to prompt files; the built-in sets "
                f"{', '.join(self.prompt_sets)} follow their chat template"
            )


class ReplyDrift(Evaluation):
    name = "reply"
    Settings = ReplySettings
    IDENTITY = ("add_bos", "n_score")

    def positions(self, ctx_tokens: int, decode_tokens: int) -> tuple[int, int]:
        tail = max(self.settings.n_score, decode_tokens)
        return tail, ctx_tokens + tail

    def scored_sets(self, tokenizer: Tokenizer, ctx_tokens: int) -> list[ScoredSet]:
        s = self.settings
        names = [(n if n in PROMPT_SETS else Path(n).stem, f"prompt set {n}") for n in s.prompt_sets]
        for (name, given), entry in zip(names, s.prompt_sets, strict=True):
            if entry not in PROMPT_SETS and name in PROMPT_SETS:
                raise UserError(
                    f"prompt file {entry} has the name of the built-in prompt set {name!r}: rename the file"
                )
        unique_names(names)
        out = []
        for (name, _), entry in zip(names, s.prompt_sets, strict=True):
            if entry in PROMPT_SETS:
                prompts, add_bos = [build_prompt(tokenizer, entry, ctx_tokens)], None
            elif not Path(entry).suffix and not Path(entry).exists():
                raise UserError(
                    f"unknown prompt set {entry!r}: the built-in sets are {', '.join(PROMPT_SETS)}; "
                    "other prompts come from a .txt or .jsonl file"
                )
            else:
                add_bos = bos_first(s.add_bos, tokenizer)
                bos = [tokenizer.bos_token_id] if add_bos else []
                texts = load_text_prompts(entry)
                prompts = [bos + build_text_prompt(tokenizer, t, ctx_tokens - len(bos)) for t in texts]
            items = tuple(Item(tuple(p), None, s.n_score) for p in prompts)
            identity = {"add_bos": add_bos, "n_score": s.n_score}
            out.append(ScoredSet(name, items, "prompt", identity, timed=len(items), stream=f"n{s.n_score}"))
        return out
