"""Loads one file into a ClickHouse MergeTree table through chDB (ClickHouse
in this process) and prints what it cost as one JSON line: the side of
`ferry bench ingest --vs-clickhouse` that ferry is measured against.

    python clickhouse_load.py FORMAT FILE WORKDIR

FORMAT is ndjson, csv, arrow or parquet. The table has the benchmark's ten
columns, partitioned by day as ferry's table is. CPU is this process's
(every ClickHouse thread), from getrusage; memory is its peak resident set
and the resident set before the insert (Python and ClickHouse loaded).
"""

import json
import resource
import sys
import time

FORMATS = {
    "ndjson": "JSONEachRow",
    "csv": "CSVWithNames",
    "arrow": "ArrowStream",
    "parquet": "Parquet",
}

TABLE = """
CREATE TABLE bench (
    id Int64,
    user_id Int64,
    amount Float64,
    ok Bool,
    name String,
    day Date32,
    ts DateTime64(6, 'UTC'),
    code Int32,
    note Nullable(String),
    score Nullable(Float64)
) ENGINE = MergeTree PARTITION BY toDate(ts) ORDER BY id
"""


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    fmt, path, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
    from chdb import session

    s = session.Session(workdir)
    s.query("CREATE DATABASE IF NOT EXISTS b")
    s.query("USE b")
    s.query("DROP TABLE IF EXISTS bench")
    s.query(TABLE)
    # Timestamps as Arrow's JSON and CSV writers print them (ISO 8601).
    s.query("SET date_time_input_format = 'best_effort'")
    before_rss = rss_kib()
    cpu0, t0 = cpu_seconds(), time.monotonic()
    quoted = path.replace("\\", "\\\\").replace("'", "\\'")
    s.query(f"INSERT INTO bench FROM INFILE '{quoted}' FORMAT {FORMATS[fmt]}")
    wall = time.monotonic() - t0
    cpu = cpu_seconds() - cpu0
    rows = int(str(s.query("SELECT count() FROM bench", "CSV")).strip())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "format": fmt,
        "rows": rows,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_kib": peak,
        "rss_before_kib": before_rss,
        "version": s.query("SELECT version()", "CSV").data().strip().strip('"'),
    }))


if __name__ == "__main__":
    main()
