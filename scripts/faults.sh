#!/usr/bin/env bash
# Real processes under real faults (crates/ferry/tests/faults.rs): installs
# what it needs like scripts/test.sh, builds, then runs the one test that
# starts its own ZooKeeper, S3 server (moto), 3 safekeepers, a supervised
# writer and 4 replicas on loopback, injects the schedule of faults, checks
# every acknowledged insert once on the replicas and once in the lake as
# pyiceberg and DuckDB read it, `ferry verify --deep`, that no process is
# left, and prints a table of the faults and what the client saw.
# Bounded: the run stops after 15 minutes whatever happens.
#
#   scripts/faults.sh
#
# scripts/test.sh runs the same test with the rest of the suite.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=scripts/services.sh
. "$root/scripts/services.sh"

install_zookeeper
install_moto
install_lake_readers

export FERRY_TEST_ZK_CLASSPATH="$zk_classpath"
export FERRY_TEST_MOTO="$venv/bin/moto_server"
export FERRY_TEST_PYTHON="$venv/bin/python"
export FERRY_TEST_REQUIRE_SERVICES=1

log "building"
cargo test -p ferry --test faults --locked --no-run -q
log "running (at most 15 minutes)"
# Job control puts the test and every process it starts in a process group
# of their own, which the watchdog ends whole if the test overruns.
set -m
cargo test -p ferry --test faults --locked -q -- --nocapture &
test_pid=$!
(sleep 900 && log "15 minutes passed: stopping the test and its processes" && kill -KILL -- "-$test_pid") &
watchdog=$!
rc=0
wait "$test_pid" || rc=$?
set +m
kill -- "-$watchdog" 2>/dev/null || true
wait "$watchdog" 2>/dev/null || true
exit "$rc"
