#!/usr/bin/env bash
# Fresh windows of random seeds for every simulator workload: the regression
# seeds in `cargo test` prove old bugs stay fixed; only new windows find new
# ones. The window moves with the date (one window a day, apart from the
# suite's own daily window) and can be set to repeat a run:
#
#   scripts/soak.sh                      # today's window
#   SOAK_DAY=20700 scripts/soak.sh       # the window of day 20700 since 1970
#   SOAK_WAL_SEEDS=2000 scripts/soak.sh  # fewer seeds (defaults below)
#
# Prints one summary line per workload and every failing seed with the
# command that replays it; exits non-zero if any seed failed.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

day=${SOAK_DAY:-$(( $(date -u +%s) / 86400 ))}
base=$(( 10000000 + (day % 10000) * 100000 ))
wal_seeds=${SOAK_WAL_SEEDS:-20000}
replica_seeds=${SOAK_REPLICA_SEEDS:-3000}
export_seeds=${SOAK_EXPORT_SEEDS:-5000}
e2e_seeds=${SOAK_E2E_SEEDS:-2000}
membership_seeds=${SOAK_MEMBERSHIP_SEEDS:-10000}

echo "[soak] day $day: seeds $base.. (SOAK_DAY=$day repeats this window)"
cargo build --release --locked -q -p ferry-sim || exit 1
sim="$root/target/release/ferry-sim"

failed=0
run() {
    local workload=$1 seeds=$2 out
    out=$("$sim" "$workload" --seeds "$seeds" --start-seed "$base" 2>&1)
    local rc=$?
    echo "$out" | grep -E "^FAILED seed" | while read -r line; do
        seed=$(echo "$line" | sed -E 's/^FAILED seed ([0-9]+).*/\1/')
        echo "[soak] $workload: $line"
        echo "[soak]   replay: cargo run --release -p ferry-sim -- $workload --seed $seed --log"
    done
    echo "[soak] $workload: $(echo "$out" | grep -E "^[0-9]+ seeds in" | tail -n 1)"
    if [ $rc -ne 0 ]; then failed=1; fi
}

run wal "$wal_seeds"
run replicas "$replica_seeds"
run export "$export_seeds"
run e2e "$e2e_seeds"
run membership "$membership_seeds"

if [ $failed -ne 0 ]; then
    echo "[soak] FAILED: see the seeds above"
    exit 1
fi
echo "[soak] every seed passed"
