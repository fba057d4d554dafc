"""Progress bars that stay readable in a log file.

On a terminal a bar is an ordinary tqdm bar redrawn in place. When stderr is not a terminal (output
sent to a file, a CI log, a cluster job's log), tqdm would still write a carriage-return frame per
update and a log would hold thousands of them per stage; there each bar writes one plain line when
it starts, then at most one line every :data:`LOG_INTERVAL_S` seconds, and one when it ends.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

LOG_INTERVAL_S = 30.0


class _Lines:
    """A file-like wrapper turning tqdm's carriage-return frames into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        text = s.replace("\r", "").strip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int | None, desc: str | None, unit: str = "tok", initial: int = 0, **kwargs) -> tqdm:
    """A tqdm bar over ``total`` units (``desc=None``: a disabled bar), on stderr.

    Args:
        total: units of work (None: unknown).
        desc: the bar's label; None disables the bar.
        unit: tqdm's unit label (``tok``, ``B``, ``tensor``).
        initial: units already done (a resumed pass).
        kwargs: more tqdm arguments (``unit_scale``, ``leave``).
    """
    if desc is None:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, **({"leave": False} | kwargs))
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        file=_Lines(sys.stderr),
        mininterval=LOG_INTERVAL_S,
        maxinterval=LOG_INTERVAL_S,
        ascii=True,
        dynamic_ncols=False,
        ncols=100,
        **(kwargs | {"leave": True}),
    )
