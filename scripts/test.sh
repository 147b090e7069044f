#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need (Debian's
# zookeeper package, moto[s3], the lake readers pyiceberg and DuckDB, and chDB
# for the ClickHouse comparison, in a venv inside the checkout), starts ZooKeeper and the
# S3 server on free loopback ports, runs formatting, lint and every test, and stops the
# services whatever happens. Extra arguments go to `cargo test`.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=scripts/services.sh
. "$root/scripts/services.sh"

# A clean build of every test binary needs about 12 GiB (less without the
# incremental cache, see .ci/run); fail early and say so rather than dying in
# the linker with "No space left on device".
check_free_disk() {
    local need_gib=${FERRY_TEST_MIN_FREE_GIB:-15} target="${CARGO_TARGET_DIR:-$root/target}" avail_kib
    mkdir -p "$target"
    avail_kib=$(df -Pk "$target" | awk 'NR == 2 { print $4 }')
    if [ "$avail_kib" -lt $((need_gib * 1024 * 1024)) ] && [ ! -d "$target/debug/deps" ]; then
        log "only $((avail_kib / 1024 / 1024)) GiB free under $target; a clean test build needs about $need_gib GiB (set FERRY_TEST_MIN_FREE_GIB to override)"
        exit 1
    fi
    log "$((avail_kib / 1024 / 1024)) GiB free under $target"
}

check_free_disk
install_zookeeper
install_moto
install_lake_readers
install_chdb

zk_port=$(free_port)
start_zookeeper "$zk_port"
s3_port=$(free_port)
start_moto "$s3_port"

export FERRY_TEST_ZK="127.0.0.1:$zk_port"
export FERRY_TEST_S3_ENDPOINT="http://127.0.0.1:$s3_port"
export FERRY_TEST_PYTHON="$venv/bin/python"
# The process fault test runs servers of its own (it stops and pauses them).
export FERRY_TEST_ZK_CLASSPATH="$zk_classpath"
export FERRY_TEST_MOTO="$venv/bin/moto_server"
export FERRY_TEST_REQUIRE_SERVICES=1

log "the product binary carries no test-only tokio features"
if cargo tree -p ferry -e normal -i tokio --format '{p} {f}' --locked | head -n 1 | grep -q test-util; then
    log "tokio's test-util reaches the ferry binary (cargo tree -p ferry -e normal -i tokio)"
    exit 1
fi
log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
log "cargo test"
cargo test --workspace --locked "$@"
log "all checks passed"
