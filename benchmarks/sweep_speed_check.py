"""Do the sweep's decode speeds agree with the decode benchmark's? (issue 12, item 5)

    python -m benchmarks.sweep_speed_check BENCH_DECODE.parquet RUNS_DIR [--out FILE.md]

Joins every sweep row of RUNS_DIR (tileinfer.jobs.rows.read_sweep) with the row of
``python -m benchmarks.decode`` for the same model, quant, backend and context in the
``graph_greedy`` mode (the decode graph ending in the argmax, the host reading each token: how the
sweep times its decode steps), and prints the ratio sweep / bench with the sweep's spread over its
timed repetitions. A ratio outside [0.95, 1.05] is marked; exit status 1 when any is.
"""

import argparse
import sys
from pathlib import Path

import polars as pl

from tileinfer.jobs.rows import read_sweep

TOLERANCE = 0.05  # issue 12: a sweep row's decode tok/s within 5% of bench.decode's for the same shape


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path, help="decode.parquet written by python -m benchmarks.decode")
    ap.add_argument("runs_dir", type=Path)
    ap.add_argument("--out", type=Path, help="also write the table as Markdown here")
    a = ap.parse_args(argv)
    bench = (
        pl.read_parquet(a.bench)
        .filter(pl.col("mode") == "graph_greedy")
        .select("model", "quant", "backend", pl.col("ctx").alias("ctx_tokens"), pl.col("tok_s").alias("bench_tok_s"))
    )
    rows, _, _ = read_sweep(a.runs_dir)
    sweep = rows.select(
        "model",
        "quant",
        "backend",
        "ctx_tokens",
        "prompt_set",
        "decode_reps",
        "decode_tok_s",
        "decode_tok_s_min",
        "decode_tok_s_max",
    )
    df = (
        sweep.join(bench, on=["model", "quant", "backend", "ctx_tokens"], how="inner")
        .with_columns((pl.col("decode_tok_s") / pl.col("bench_tok_s")).round(3).alias("sweep_over_bench"))
        .with_columns(((pl.col("sweep_over_bench") - 1).abs() > TOLERANCE).alias("outside_5pct"))
        .sort("model", "quant", "backend", "ctx_tokens", "prompt_set")
        .with_columns(pl.col("^decode_tok_s.*$").round(1))
    )
    if df.is_empty():
        print("no sweep row matches a bench.decode row (model, quant, backend, ctx)", file=sys.stderr)
        return 2
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200):
        print(df)
    if a.out:
        head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
        body = "".join("| " + " | ".join(str(v) for v in r) + " |\n" for r in df.iter_rows())
        a.out.write_text(head + body)
    return int(df["outside_5pct"].any())


if __name__ == "__main__":
    sys.exit(main())
