"""Compare the rows of two runs folders, e.g. before and after a refactor that must not change numbers.

    python -m benchmarks.compare_rows RUNS_BEFORE RUNS_AFTER

Rows are matched on (model, quant, smooth_keys, ctx, prompt_set, backend); every column both have,
except timings and provenance, must be equal bit for bit, and so must the per-position tables.
Rows are read by the one reader of result rows (tileinfer.jobs.rows.read, old column names under
today's). Exit 1 when anything differs.
"""

import sys
from pathlib import Path

import polars as pl

from tileinfer.jobs import rows as result_rows

KEY = ["model", "quant", "smooth_keys", "ctx", "prompt_set", "backend"]
NOT_COMPARED = {
    "prefill_ms",
    "prefill_tok_s",
    "decode_tok_s",
    "decode_tok_s_min",
    "decode_tok_s_max",
    "decode_ms_per_tok",
    "wall_s",
    # the allocator's peak counts the models a worker keeps from its earlier jobs (tileinfer.jobs.job)
    "peak_mem_bytes",
    "device_workers",  # one worker per device or two sharing one: the speeds differ, nothing else may
    "finished_at",
    "git_commit",
    "row_file",
}


def rows(runs: str) -> pl.DataFrame:
    return result_rows.read(Path(runs) / "rows").sort(KEY)


def main(before: str, after: str) -> int:
    a, b = rows(before), rows(after)
    print(f"rows: {len(a)} before, {len(b)} after")
    if a.select(KEY).to_dicts() != b.select(KEY).to_dicts():
        print("the two folders hold different configurations")
        return 1
    common = [c for c in a.columns if c in b.columns and c not in NOT_COMPARED]
    differ = [c for c in common if not a[c].equals(b[c])]
    print(f"{len(common)} columns compared; differ: {', '.join(differ) or 'none'}")
    for c in differ:
        print(f"  {c}: {a[c].to_list()} -> {b[c].to_list()}")
    print(
        f"only before: {sorted(set(a.columns) - set(b.columns))}; only after: {sorted(set(b.columns) - set(a.columns))}"
    )
    same_positions = all(
        pl.read_parquet(result_rows.positions_path(fa)).equals(pl.read_parquet(result_rows.positions_path(fb)))
        for fa, fb in zip(a["row_file"], b["row_file"], strict=True)
    )
    print(f"per-position tables: {'bit-identical' if same_positions else 'DIFFER'}")
    return 0 if not differ and same_positions else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
