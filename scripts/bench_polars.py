"""The polars peer of the offline benchmark (scripts/bench-offline.sh).

    bench_polars.py counts CALLS.csv OUT.parquet   per-call sliding counts (60 s, 1 h)

The same counts as bench_duckdb.py, with polars' rolling group-by: per
caller, calls in (t - W, t], less the same-millisecond calls later in the
file (callguard counts a call's earlier calls only). Check the output with
`bench_duckdb.py check`.
"""

import sys

import polars as pl

WINDOWS = {"count_minute": 60_000, "count_hour": 3_600_000}


def counts(src, out):
    calls = (
        pl.scan_csv(src, infer_schema=False)
        .select("call_id", "caller", "ts")
        .with_row_index("rn")
        .with_columns(
            pl.col("ts").str.to_datetime(time_zone="UTC").dt.epoch("ms").alias("t")
        )
        .sort("t", maintain_order=True)
        # Same-millisecond calls of the caller later in the file.
        .with_columns(
            (pl.len().over("caller", "t") - pl.int_range(1, pl.len() + 1).over("caller", "t"))
            .alias("later")
        )
    )
    result = calls.select(
        "call_id",
        *[
            (
                pl.col("rn")
                .count()
                .rolling(index_column="t", period=f"{w}i", closed="right")
                .over("caller")
                - pl.col("later")
            ).alias(name)
            for name, w in WINDOWS.items()
        ],
    )
    result.sink_parquet(out)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "counts":
        sys.exit(__doc__)
    counts(sys.argv[2], sys.argv[3])
