"""``hetmoe``: one sub-command per job; each lives in its own module of this package."""

from __future__ import annotations

import argparse
import os
import sys

from ..kernels.dispatch import EngineUnavailableError
from ..runtime.process_group import RankLostError
from . import bench, chat, convert, demo, doctor, eval, generate, gptq, inspect_cmd, plan, serve, sft

COMMANDS = (inspect_cmd, convert, demo, doctor, bench, gptq, generate, eval, plan, serve, chat, sft)


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(
        prog="hetmoe",
        description=(
            "Run Mixture-of-Experts models with routed experts in CPU memory, and the format tooling around them."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser, sub


def parse(
    parser: argparse.ArgumentParser, commands: argparse._SubParsersAction, argv: list[str] | None
) -> argparse.Namespace:
    """The command line, with options allowed between a command's positionals: argparse alone gives
    `hetmoe generate MODEL --max-new-tokens 8 PROMPT` "unrecognized arguments: PROMPT", because it
    fills both optional positionals at MODEL. Where that happens, the command's own parser reads its
    arguments again with options and positionals intermixed (commands with sub-commands of their own
    cannot: they get argparse's error as before)."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    if not getattr(args, "command", None):
        return parser.parse_args(argv)  # argparse's own error
    words = list(sys.argv[1:] if argv is None else argv)
    sub = commands.choices[args.command]
    try:
        return sub.parse_intermixed_args(
            words[words.index(args.command) + 1 :], argparse.Namespace(command=args.command)
        )
    except TypeError:  # a sub-command with sub-parsers: intermixing is not defined for it
        return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser, commands = _build()
    args = parse(parser, commands, argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (ValueError, EngineUnavailableError, RankLostError) as exc:
        # Bad input, unmet requirements (FormatError and CheckpointError are ValueErrors) and a lost
        # peer process get one clear line; HETMOE_DEBUG=1 shows the traceback instead.
        if os.environ.get("HETMOE_DEBUG"):
            raise
        print(f"hetmoe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hetmoe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
