"""The one exception type for mistakes a user can make (bad checkpoint, bad config, prompt too long).

Entry points catch :class:`UserError`, print its message as one line and exit non-zero, so users see
no traceback for their own mistakes; every other exception is a bug and keeps its traceback.
"""

import sys
from contextlib import contextmanager


class UserError(Exception):
    """A mistake in the user's input; the message is one complete, readable line."""


@contextmanager
def exit_on_user_error(prog: str):
    """Turn a :class:`UserError` raised inside the block into ``prog: error: ...`` and exit code 1.

    Also turns ``torch.cuda.OutOfMemoryError`` into one line, since running out of GPU memory is a
    sizing choice of the user (model, ctx), not a bug.
    """
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - only the OOM case is handled, the rest re-raised
        if type(e).__name__ == "OutOfMemoryError":
            print(f"{prog}: error: out of GPU memory ({str(e).splitlines()[0]}); "
                  "try a smaller model, ctx or kv page pool", file=sys.stderr)
            sys.exit(1)
        raise
