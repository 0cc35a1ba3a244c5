"""``hetmoe``: one sub-command per job; each lives in its own module of this package."""

from __future__ import annotations

import argparse
import os
import sys

from ..kernels.dispatch import EngineUnavailableError
from . import bench, chat, convert, demo, doctor, eval, generate, gptq, inspect_cmd, plan, serve, sft

COMMANDS = (inspect_cmd, convert, demo, doctor, bench, gptq, generate, eval, plan, serve, chat, sft)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetmoe",
        description=(
            "Run Mixture-of-Experts models with routed experts in CPU memory, and the format tooling around them."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (ValueError, EngineUnavailableError) as exc:
        # Bad input and unmet requirements (FormatError and CheckpointError are ValueErrors) get one
        # clear line; HETMOE_DEBUG=1 shows the traceback instead.
        if os.environ.get("HETMOE_DEBUG"):
            raise
        print(f"hetmoe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hetmoe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
