"""Command line: `python -m kt_kernel info | bench | convert` (also installed as `kt-kernel`)."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kt-kernel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="CPU flags, builds present, the build chosen and why")
    info.add_argument("--json", action="store_true", help="print cpu_info() as JSON")
    bench = commands.add_parser("bench", help="time the standard MoE workload (see docs/performance.md)")
    from kt_kernel.bench import add_arguments
    from kt_kernel.formats import FORMATS

    add_arguments(bench)
    convert = commands.add_parser(
        "convert",
        help=f"convert a checkpoint's routed experts to {'|'.join(FORMATS).lower()} (see docs/converting.md)",
    )
    from kt_kernel.convert import add_arguments as add_convert_arguments

    add_convert_arguments(convert)
    args = parser.parse_args(argv)
    if args.command == "bench":
        from kt_kernel.bench import main as bench_main

        return bench_main(args)
    if args.command == "convert":
        from kt_kernel.convert import main as convert_main

        return convert_main(args)

    import kt_kernel
    from kt_kernel.info import format_cpu_info

    if args.command == "info":
        details = kt_kernel.cpu_info()
        print(json.dumps(details, indent=2) if args.json else format_cpu_info(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
