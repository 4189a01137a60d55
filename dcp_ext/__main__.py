"""``dcp-ext`` / ``python -m dcp_ext``: command-line entry point."""

from __future__ import annotations

import argparse
import sys

from . import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-ext", description="dcp_ext command-line tool")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="save and load a sharded checkpoint across 2 local processes"
    )
    demo.add_arguments(demo_parser)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args.path, args.width, args.depth)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
