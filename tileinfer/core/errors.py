"""The engine's exceptions for mistakes in what it is given (a bad checkpoint, setting or prompt).

The engine raises these and nothing else about the user's input; what a command makes of them (one
line on stderr, an exit code) is decided by the command layer alone (:mod:`tileinfer.cli`). Every
other exception is a bug in the code and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input (checkpoint, setting, prompt, file); the message is one
    complete, readable line that says what is wrong and, where it can, what to write instead."""


class NonFiniteLogits(UserError):
    """A model produced NaN or infinite logits: a corrupt checkpoint, an overflowing dtype, or a
    broken kernel (which the drift gate reports as a failed check)."""
