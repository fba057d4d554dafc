"""The one exception type for mistakes a user can make (bad checkpoint, bad config, prompt too long).

Entry points catch :class:`UserError`, print its message as one line and exit non-zero, so users see
no traceback for their own mistakes; every other exception is a bug and keeps its traceback.
"""

import sys
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """A mistake in the user's input; the message is one complete, readable line."""


class NonFiniteLogits(UserError):
    """A model produced NaN or infinite logits: a corrupt checkpoint, an overflowing dtype, or a
    broken kernel (which the drift gate reports as a failed check)."""


@contextmanager
def exit_on_user_error(prog: str, code: int = 1):
    """Turn a :class:`UserError` raised inside the block into ``prog: error: ...`` and exit ``code``.

    Also turns into one line: ``torch.cuda.OutOfMemoryError`` (running out of GPU memory is a sizing
    choice of the user: model, ctx), an OS error on a named file (a folder that cannot be written, a
    full disk) and Ctrl-C (exit 130; whatever was written is complete, since results are written
    atomically).
    """
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(code)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished results are kept, the same command resumes", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        if e.filename is None:
            raise
        print(f"{prog}: error: {e.filename}: {e.strerror}", file=sys.stderr)
        sys.exit(code)
    except Exception as e:  # noqa: BLE001 - only the OOM case is handled, the rest re-raised
        if type(e).__name__ == "OutOfMemoryError":
            print(
                f"{prog}: error: out of GPU memory ({str(e).splitlines()[0]}); "
                "try a smaller model, ctx or kv page pool",
                file=sys.stderr,
            )
            sys.exit(code)
        raise


def check_runs_dir(prog: str, argv: list[str], default: str = "runs", exit_code: int = 1) -> None:
    """Exit with one line when the ``runs_dir=`` of the command line (else ``default``) cannot be
    created: Hydra makes its log folder there before any of this project's code runs, and would
    answer with a traceback."""
    given = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("runs_dir=")]
    path = Path(given[-1] if given else default)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"{prog}: error: runs_dir {path}: {e.strerror}", file=sys.stderr)
        sys.exit(exit_code)
