"""Command line: ``python -m fastlayers env`` and ``python -m fastlayers check [MODEL]``."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def _env() -> int:
    from fastlayers import env_report

    text, imported = env_report.report()
    print(text)
    return 0 if imported else 1


class _Parser(argparse.ArgumentParser):
    """Bad usage is one line (and exit code 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    from fastlayers.patching.checking import cli as check_cli

    parser = _Parser(prog="python -m fastlayers")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser(
        "env", help="versions, how the extension was built, which path each op takes per GPU"
    )
    check = sub.add_parser(
        "check",
        help="patch a model, compare outputs before/after, time both",
        description=check_cli.DESCRIPTION,
    )
    check_cli.add_arguments(check)
    args = parser.parse_args(argv)
    if args.command == "env":
        return _env()
    try:
        return check_cli.run(args)
    except check_cli.UsageError as err:
        print(f"python -m fastlayers check: error: {err}", file=sys.stderr)
        return check_cli.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
