"""Command line: `python -m kt_kernel info | bench` (also installed as `kt-kernel`)."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kt-kernel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="CPU flags, builds present, the build chosen and why")
    info.add_argument("--json", action="store_true", help="print cpu_info() as JSON")
    bench = commands.add_parser("bench", help="time the standard MoE workload (see README, Performance)")
    from kt_kernel.bench import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "bench":
        from kt_kernel.bench import main as bench_main

        return bench_main(args)

    import kt_kernel
    from kt_kernel.info import format_cpu_info

    if args.command == "info":
        details = kt_kernel.cpu_info()
        print(json.dumps(details, indent=2) if args.json else format_cpu_info(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
