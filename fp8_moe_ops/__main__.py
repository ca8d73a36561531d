"""Command line: ``python -m fp8_moe_ops demo`` (also installed as ``fp8-moe``).

A thin wrapper: the demo itself is :mod:`fp8_moe_ops.demo`; nothing imports this
module.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from . import demo

    parser = argparse.ArgumentParser(prog="fp8-moe", description="fp8_moe_ops command line.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_arguments(sub.add_parser(
        "demo", help="build, compile, check and export a small FP8 MoE model",
        description=demo.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
