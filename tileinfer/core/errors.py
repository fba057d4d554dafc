"""The one exception type for mistakes a user can make (bad checkpoint, bad config, prompt too long).

Entry points catch :class:`UserError`, print its message as one line and exit 2 (argparse's code for a
usage error), so users see no traceback for their own mistakes; every other exception is a bug and
keeps its traceback (exit 1, as is the gate's failed check).
"""

import sys
from contextlib import contextmanager
from pathlib import Path

USAGE_ERROR = 2  # exit code of every user error


class UserError(Exception):
    """A mistake in the user's input; the message is one complete, readable line."""


class NonFiniteLogits(UserError):
    """A model produced NaN or infinite logits: a corrupt checkpoint, an overflowing dtype, or a
    broken kernel (which the drift gate reports as a failed check)."""


@contextmanager
def exit_on_user_error(prog: str):
    """Turn a :class:`UserError` raised inside the block into ``prog: error: ...`` and exit :data:`USAGE_ERROR`.

    Also turns into one line: ``torch.cuda.OutOfMemoryError`` (running out of GPU memory is a sizing
    choice of the user: model, ctx), an OS error on a named file (a folder that cannot be written, a
    full disk) and Ctrl-C (exit 130; whatever was written is complete, since results are written
    atomically).
    """
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished results are kept, the same command resumes", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        if e.filename is None:
            raise
        print(f"{prog}: error: {e.filename}: {e.strerror}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    except Exception as e:  # noqa: BLE001 - only the OOM case is handled, the rest re-raised
        if type(e).__name__ == "OutOfMemoryError":
            print(
                f"{prog}: error: out of GPU memory ({str(e).splitlines()[0]}); "
                "try a smaller model, ctx or kv page pool",
                file=sys.stderr,
            )
            sys.exit(USAGE_ERROR)
        raise


def check_runs_dir(prog: str, argv: list[str], default: str = "runs") -> None:
    """Exit with one line when the ``runs_dir=`` of the command line (else ``default``) cannot be
    created or written: Hydra makes its log folder there before any of this project's code runs, and
    would answer with a traceback.

    The value is read as Hydra reads it (quotes and escapes removed; each value of a ``-m`` sweep
    list); a part from the first ``${...}`` interpolation on is left to Hydra.
    """
    from tileinfer.core import files  # files imports this module

    for value in _runs_dir_values(argv, default):
        if value == "":
            print(f"{prog}: error: runs_dir is empty", file=sys.stderr)
            sys.exit(USAGE_ERROR)
        parts = Path(value).parts
        fixed = next((i for i, p in enumerate(parts) if "${" in p), len(parts))
        if fixed == 0 or (fixed == 1 and Path(value).is_absolute()):  # nothing fixed but the root
            continue
        try:
            files.check_writable(Path(*parts[:fixed]))
        except UserError as e:
            print(f"{prog}: error: runs_dir: {e}", file=sys.stderr)
            sys.exit(USAGE_ERROR)


def _runs_dir_values(argv: list[str], default: str) -> list[str]:
    """The ``runs_dir`` values the last ``runs_dir=`` override of ``argv`` gives, parsed by Hydra's
    own override parser; ``[default]`` without one (a malformed one is left for Hydra to report)."""
    given = [a for a in argv if a.lstrip("+").startswith("runs_dir=")]
    if not given:
        return [default]
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    try:
        value = OverridesParser.create().parse_overrides([given[-1]])[0].value()
    except Exception:  # noqa: BLE001 - Hydra's parse errors; Hydra reports them itself
        return []
    values = value.list if isinstance(value, ChoiceSweep) else [value]
    return [str(v) for v in values if isinstance(v, (str, int, float))]
