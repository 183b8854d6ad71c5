"""Command line: `python -m kt_kernel info | bench | convert | cache` (also installed as `kt-kernel`)."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kt-kernel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="CPU flags, builds present, the build chosen and why")
    info.add_argument(
        "--json", action="store_true", help="print cpu_info() (or the --memory estimate) as JSON"
    )
    info.add_argument(
        "--memory",
        metavar="PATH",
        help="the memory a model's routed experts take, in files and held, from headers (docs/formats.md)",
    )
    info.add_argument("--method", help="with --memory: the method the model will be loaded with")
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
    cache = commands.add_parser(
        "cache", help="fill an mmap_experts_dir ahead of a launch (see docs/expert-cache.md)"
    )
    from kt_kernel.cache_fill import add_arguments as add_cache_arguments

    add_cache_arguments(cache)
    args = parser.parse_args(argv)
    if args.command == "bench":
        from kt_kernel.bench import main as bench_main

        return bench_main(args)
    if args.command == "convert":
        from kt_kernel.convert import main as convert_main

        return convert_main(args)
    if args.command == "cache":
        from kt_kernel.cache_fill import main as cache_main

        return cache_main(args)

    if args.memory is not None:
        return memory_main(parser, args)
    if args.method is not None:
        parser.error("--method goes with --memory")

    import kt_kernel
    from kt_kernel.info import format_cpu_info

    if args.command == "info":
        details = kt_kernel.cpu_info()
        print(json.dumps(details, indent=2) if args.json else format_cpu_info(details))
    return 0


def memory_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``info --memory PATH``: the estimate, or a one-line error and exit status 2."""
    from kt_kernel.memory_estimate import estimate, format_estimate

    try:
        result = estimate(args.memory, args.method).as_dict()
    except (ValueError, NotImplementedError, ImportError) as error:  # CheckpointError is a ValueError
        parser.exit(2, f"kt-kernel info: error: {error}\n")
    print(json.dumps(result, indent=2) if args.json else format_estimate(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
