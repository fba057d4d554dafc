"""The evaluation contract: what a job scores, as scored sets of token ids.

An evaluation (``conf/eval/*.yaml``, its ``name`` one of :data:`evals.registry.EVALUATIONS`) turns
its settings and the model's tokenizer into scored sets, one result row each. Reply drift
(:mod:`evals.reply`) and corpus drift (:mod:`evals.corpus`) are its two implementations: both
score a candidate against a base teacher-forced over the same tokens (:mod:`evals.drift`), and
differ only in what the tokens are, how they are windowed, what the row's identity adds and which
items time decoding. Adding an evaluation is one module (a subclass of :class:`Evaluation` with its
settings dataclass), one entry in the registry and one ``conf/eval/NAME.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from evals.prompts import Tokenizer
from tileinfer.core.errors import UserError


@dataclass(frozen=True)
class Item:
    """One scored unit as token ids: ``prompt`` is fed first; the positions after it are scored.

    ``reply`` holds the scored tokens when the evaluation fixes them (a corpus window's second
    half); None means the base model's greedy reply after the prompt is the scored window, at most
    ``n_reply`` tokens, ending early at a stop token.
    """

    prompt: tuple[int, ...]
    reply: tuple[int, ...] | None
    n_reply: int


@dataclass(frozen=True)
class ScoredSet:
    """The items one row scores.

    Attributes:
        name: the row's ``prompt_set`` (a built-in prompt set, a file's stem, a corpus's name).
        items: the prompts or windows, in order.
        unit: what one item is to the intervals, which resample whole items (``prompt`` | ``window``).
        identity: the row identity columns this evaluation sets (tileinfer.jobs.identity.SCORING).
        timed: how many leading items are followed by the timed decode steps (and speculation).
        stream: what is scored, in stored base-logits file names (``n1024``: a 1024-token reply;
            ``window``: a corpus window's second half).
        columns: more row columns (a corpus's token count).
    """

    name: str
    items: tuple[Item, ...]
    unit: str
    identity: dict[str, Any]
    timed: int
    stream: str
    columns: dict[str, Any] = field(default_factory=dict)


class Evaluation:
    """Base of the evaluations: built from its settings (``Settings``, a dataclass whose fields are the
    ``eval.*`` settings, plus ``name``), it says how many positions it needs and builds the scored sets.

    Subclasses set :attr:`name`, :attr:`Settings` and :attr:`IDENTITY` (the identity columns their
    scored sets set; the union over the registry is part of every row's identity) and implement
    :meth:`positions` and :meth:`scored_sets`.
    """

    name: ClassVar[str]
    Settings: ClassVar[type]
    IDENTITY: ClassVar[tuple[str, ...]]

    def __init__(self, settings):
        self.settings = settings

    def positions(self, ctx_tokens: int, decode_tokens: int) -> tuple[int, int]:
        """(``tail``, ``max_len``): positions needed after a ``ctx_tokens`` prompt (0 when the items
        end inside the ctx), and the longest sequence a pass runs, decode steps included."""
        raise NotImplementedError

    def scored_sets(self, tokenizer: Tokenizer, ctx_tokens: int) -> list[ScoredSet]:
        """The scored sets for prompts of ``ctx_tokens`` positions.

        Raises:
            UserError: a set that cannot be built (unknown name, unreadable file, text too short).
        """
        raise NotImplementedError


def bos_first(add_bos: bool | None, tokenizer: Tokenizer) -> bool:
    """Whether texts start with BOS: the ``eval.add_bos`` setting, or (None) the tokenizer's
    ``add_bos_token``, as llama.cpp's perplexity and KL tools do.

    Raises:
        UserError: BOS asked for but the tokenizer has none.
    """
    want = tokenizer.add_bos_token if add_bos is None else add_bos
    if want and tokenizer.bos_token_id is None:
        raise UserError("eval.add_bos=true but the tokenizer has no BOS token")
    return bool(want)


def unique_names(names: list[tuple[str, str]]) -> None:
    """Raise UserError when two entries (``(name, as given)``) share a name: rows, stored base logits
    and caches are named by it."""
    seen: dict[str, str] = {}
    for name, given in names:
        if name in seen:
            raise UserError(f"{given} has the name {name!r} of {seen[name]}: rename the file")
        seen[name] = given
