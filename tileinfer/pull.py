"""Download a model (or check a local path) and print its local path.

    python -m tileinfer.pull NAME [--home DIR]

NAME is a model of ``conf/model`` or a local path; see :mod:`tileinfer.core.fetch` for the sources.
"""

from __future__ import annotations

import argparse

from tileinfer.cli import exit_on_error
from tileinfer.core.fetch import known_models, pull


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tileinfer.pull",
        description="Download a model (or check a local path) and print its local path.",
    )
    parser.add_argument("name", help=f"model name ({', '.join(known_models())}) or a local path")
    parser.add_argument("--home", help="cache folder (default $TILEINFER_HOME or ~/.cache/tileinfer)")
    args = parser.parse_args(argv)
    with exit_on_error("tileinfer.pull"):
        print(pull(args.name, home=args.home))


if __name__ == "__main__":
    main()
