"""The DuckDB peer of the offline benchmark (scripts/bench-offline.sh).

    bench_duckdb.py counts CALLS.csv OUT.parquet   per-call sliding counts (60 s, 1 h)
    bench_duckdb.py sweep  CALLS.csv OUT.csv       the one-minute rule swept over N = 1..200
    bench_duckdb.py check  CALLGUARD.parquet DUCKDB.parquet
    bench_duckdb.py check-sweep CALLGUARD.csv DUCKDB.csv

The counts follow callguard's contract for a time-sorted log without
duplicates: 1 + earlier calls of the caller with ts in (t - W, t], where
"earlier" among calls in the same millisecond means earlier in the file.
`check` demands that callguard's feature file holds exactly these counts.
"""

import sys

import duckdb

WINDOWS = {"count_minute": 60_000, "count_hour": 3_600_000}


def load(con, path):
    # File order is kept (insertion order) and numbered, for same-millisecond ties.
    con.execute(
        f"""CREATE TABLE calls AS
        SELECT row_number() OVER () AS rn, call_id, caller,
               epoch_ms(CAST(ts AS TIMESTAMPTZ)) AS t, label = 'fraud' AS fraud
        FROM read_csv('{path}', all_varchar = true, header = true)"""
    )


def count_expr(name, w):
    # Calls in (t - W, t], less the same-millisecond calls later in the file.
    return f"""count(*) OVER (PARTITION BY caller ORDER BY t
                     RANGE BETWEEN {w - 1} PRECEDING AND CURRENT ROW)
             - count(*) OVER (PARTITION BY caller, t ORDER BY rn
                     ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS {name}"""


def counts(src, out):
    con = duckdb.connect()
    load(con, src)
    cols = ",\n".join(count_expr(n, w) for n, w in WINDOWS.items())
    con.execute(f"COPY (SELECT call_id, {cols} FROM calls) TO '{out}' (FORMAT parquet)")


def sweep(src, out):
    con = duckdb.connect()
    load(con, src)
    con.execute(f"CREATE TABLE c AS SELECT caller, fraud, {count_expr('cnt', 60_000)} FROM calls")
    con.execute(
        """CREATE TABLE callers AS
        SELECT caller, max(cnt) AS peak, bool_or(fraud) AS fraud FROM c GROUP BY caller"""
    )
    con.execute(
        f"""COPY (
        WITH n AS (SELECT range AS n FROM range(1, 201)),
        h AS (SELECT cnt, count(*) FILTER (fraud) AS f, count(*) FILTER (NOT fraud) AS l
              FROM c GROUP BY cnt),
        p AS (SELECT peak, count(*) FILTER (fraud) AS f, count(*) FILTER (NOT fraud) AS l
              FROM callers GROUP BY peak),
        calls_n AS (SELECT n, coalesce(sum(f), 0) AS fraud_calls_rejected,
                           coalesce(sum(l), 0) AS legit_calls_rejected
                    FROM n LEFT JOIN h ON h.cnt > n.n GROUP BY n),
        callers_n AS (SELECT n, coalesce(sum(f), 0) AS fraud_callers_caught,
                             coalesce(sum(l), 0) AS legit_callers_rejected
                      FROM n LEFT JOIN p ON p.peak > n.n GROUP BY n)
        SELECT n AS limit, fraud_calls_rejected, legit_calls_rejected,
               fraud_callers_caught, legit_callers_rejected
        FROM calls_n JOIN callers_n USING (n) ORDER BY n
        ) TO '{out}' (FORMAT csv, HEADER)"""
    )


def check(ours, theirs):
    con = duckdb.connect()
    cond = " OR ".join(f"a.{n} <> b.{n}" for n in WINDOWS)
    total, joined, differ = con.execute(
        f"""SELECT (SELECT count(*) FROM '{ours}'), count(*), count(*) FILTER ({cond})
        FROM '{ours}' a JOIN '{theirs}' b USING (call_id)"""
    ).fetchone()
    print(f"compared {joined} of {total} calls: {differ} differ")
    if differ or joined != total:
        sys.exit(1)


def check_sweep(ours, theirs):
    con = duckdb.connect()
    cols = ["fraud_calls_rejected", "legit_calls_rejected", "fraud_callers_caught", "legit_callers_rejected"]
    cond = " OR ".join(f"a.{c} <> b.{c}" for c in cols)
    joined, differ = con.execute(
        f"""SELECT count(*), count(*) FILTER ({cond})
        FROM read_csv('{ours}') a JOIN read_csv('{theirs}') b USING ("limit")"""
    ).fetchone()
    print(f"compared {joined} limits: {differ} differ")
    if differ or joined != 200:
        sys.exit(1)


if __name__ == "__main__":
    modes = {"counts": counts, "sweep": sweep, "check": check, "check-sweep": check_sweep}
    modes[sys.argv[1]](*sys.argv[2:])
