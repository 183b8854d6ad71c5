"""``python -m kt_kernel bench --guard``: never slower than torch, on whatever CPU runs it.

Prefill rows (qwen3-30b, T=512) of every format on every build this CPU runs, each build also without
the finer paths this CPU offers it (avx512-plain, avx2-plain: bench_common.PLAIN_ENV), each row beside torch
held to that build's instruction set and timed in the same worker process (bench.run_worker). A row
slower than torch is timed once more, alone with its baseline; one slower twice fails the guard (exit
status 1). CI runs it after the tests, so a CPU family whose figures nobody looked at still cannot
ship a kernel that loses to the library a user would pick instead.
"""

from __future__ import annotations

import argparse

from . import bench_common

SHAPE, TOKENS = "qwen3-30b", 512
CALLS, ROW_SECONDS = 5, 2.0  # medians of 5 calls: a margin of 2x or more is the rule, not the exception


def refusal(args: argparse.Namespace) -> str | None:
    """What the guard cannot honour among the other options (None: nothing)."""
    if args.model or args.gpu or args.quick:
        return "--guard times single-layer prefill rows: drop --model, --gpu and --quick"
    if not args.torch:
        return "--guard compares with torch: drop --no-torch"
    if args.activations != ["exact"]:
        return "--guard times the default (exact) activations only: drop --activations"
    return None


def slower_than_torch(row: dict) -> bool:
    return row["speedup_vs_torch"] < 1.0


def timed_rows(args: argparse.Namespace, runs: list, formats: list[str]) -> list[tuple[int, dict]]:
    """(index of its run in `runs`, row) of every row the workers time."""
    args.format = formats
    workers = bench_common.run_workers(args, runs)
    return [(index, row) for index, worker in enumerate(workers) for row in worker["rows"]]


def format_guard_table(rows: list[tuple[dict, dict | None]], threads: int) -> str:
    header = (
        f"{'build':<12} {'shape':<10} {'format':<7} {'T':>4} {'ms':>8} {'torch ms':>9} {'speedup':>8} verdict"
    )
    lines = [f"guard: ours beside torch held to each build's instructions, {threads} threads", header,
             "-" * len(header)]  # fmt: skip
    for first, retry in rows:
        row = retry or first
        verdict = "ok" if not slower_than_torch(row) else "SLOWER than torch"
        if retry:
            verdict += f" (retried; first {first['median_ms']:.2f} vs {first['torch_median_ms']:.2f} ms)"
        lines.append(
            f"{row['variant']:<12} {row['shape']:<10} {row['format']:<7} {row['tokens']:>4} "
            f"{row['median_ms']:>8.2f} {row['torch_median_ms']:>9.2f} {row['speedup_vs_torch']:>7.2f}x"
            f"  {verdict}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    problem = refusal(args)
    if problem:
        return bench_common.usage_error(problem)
    args.shape, args.tokens = args.shape or [SHAPE], args.tokens or [TOKENS]
    args.calls, args.row_seconds = CALLS, ROW_SECONDS
    try:
        runs = bench_common.variant_runs("all" if args.variant == "auto" else args.variant)
    except ValueError as error:
        return bench_common.usage_error(str(error))
    first = timed_rows(args, runs, args.format)
    retries: dict[int, dict] = {}
    for position, (run, row) in enumerate(first):
        if slower_than_torch(row):  # once more, alone with its baseline: noise rarely strikes twice
            args.shape, args.tokens = [row["shape"]], [row["tokens"]]
            [(_, retries[position])] = timed_rows(args, [runs[run]], [row["format"]])
    table = [(row, retries.get(position)) for position, (_, row) in enumerate(first)]
    print(format_guard_table(table, args.threads))
    failed = [row for first_row, retry in table if slower_than_torch(row := retry or first_row)]
    if failed:
        names = ", ".join(f"{r['variant']} {r['format']} T={r['tokens']}" for r in failed)
        print(f"\nguard FAILED: slower than torch twice: {names}")
        return 1
    print(f"\nguard passed: {len(table)} rows, none slower than torch")
    return 0
