"""``python -m cula info`` | ``python -m cula demo``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else "info"
    if command == "info":
        from .info import collect_info, format_info

        print(format_info(collect_info()))
        return 0
    if command == "demo":
        from .demo import run_demo

        run_demo()
        return 0
    print(f"usage: python -m cula [info|demo] (got {command!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
