"""Command line: ``python -m fastlayers env`` and ``python -m fastlayers check [MODEL]``."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def _env() -> int:
    import torch

    print(f"torch           {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    try:
        import fastlayers
    except ImportError as err:
        print(f"fastlayers      not importable: {err}")
        return 1
    info = fastlayers.build_info()
    archs = ", ".join(f"sm_{a}" for a in info["cuda_archs"]) or "none"
    print(f"fastlayers      {fastlayers.__version__}")
    print(f"CUDA kernels    {'built' if info['cuda'] else 'not built (CPU kernels only)'}")
    print(f"built for       {archs}")
    if not torch.cuda.is_available():
        print("GPU             none visible")
        return 0
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        covered = any(a // 10 == major and a % 10 <= minor for a in info["cuda_archs"])
        note = (
            ""
            if covered
            else "  (no kernels built for this GPU: rebuild with TORCH_CUDA_ARCH_LIST)"
        )
        print(f"GPU {i}           {torch.cuda.get_device_name(i)}, sm_{major}{minor}{note}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Bad usage is one line (and exit code 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    from fastlayers import check_cli

    parser = _Parser(prog="python -m fastlayers")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("env", help="versions, how the extension was built, the GPUs seen")
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
