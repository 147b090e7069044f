# Sourced by scripts/test.sh and scripts/faults.sh: installs what the tests
# need (Debian's zookeeper package; moto[s3] and the lake readers in a venv
# inside the checkout) and starts ZooKeeper and the S3 server on free
# loopback ports. Expects `root` (the checkout) to be set.

services="$root/.services"
venv="$root/.venv"
moto_version="5.2.5"
# Lake readers the Iceberg tests read tables with, as users run them: pyiceberg,
# and DuckDB with its Iceberg and Avro extensions from PyPI wheels (the
# extensions must match DuckDB's version exactly; nothing is fetched at run time).
lake_readers="pyiceberg[pyarrow]==0.12.0 duckdb==1.4.4 duckdb-ext==0.1.2 duckdb-ext-iceberg==1.4.4.20260205 duckdb-ext-avro==1.4.4.20260205 duckdb-ext-httpfs==1.4.4.20260205"
# How Debian's package runs ZooKeeper's server.
zk_classpath="/etc/zookeeper/conf:/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar"

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_zookeeper() {
    if [ -f /usr/share/java/zookeeper.jar ] && command -v java >/dev/null; then return; fi
    log "installing Debian's zookeeper package"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends zookeeper >/dev/null
}

install_moto() {
    if [ -x "$venv/bin/moto_server" ] && "$venv/bin/python" -c "import moto, sys; sys.exit(moto.__version__ != '$moto_version')" 2>/dev/null; then
        return
    fi
    log "installing moto[s3]==$moto_version into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "moto[s3]==$moto_version" flask flask-cors
}

install_lake_readers() {
    if "$venv/bin/python" -c "import pyiceberg, duckdb, duckdb_ext, sys; sys.exit(pyiceberg.__version__ != '0.12.0' or duckdb.__version__ != '1.4.4')" 2>/dev/null &&
        "$venv/bin/pip" show -q duckdb-ext-httpfs >/dev/null 2>&1; then
        return
    fi
    log "installing the lake readers into $venv: $lake_readers"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q --disable-pip-version-check $lake_readers
}

# ClickHouse in process (chDB), the side `ferry bench ingest --vs-clickhouse`
# measures ferry against; its tiny run is part of the suite.
chdb_version="4.4.0"
install_chdb() {
    if "$venv/bin/python" -c "import chdb, sys; sys.exit(chdb.__version__ != '$chdb_version')" 2>/dev/null; then
        return
    fi
    log "installing chdb==$chdb_version into $venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "chdb==$chdb_version"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pids=()
stop_services() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_services EXIT INT TERM

start_zookeeper() {
    local port=$1 dir="$services/zookeeper"
    rm -rf "$dir" && mkdir -p "$dir/data"
    cat >"$dir/zoo.cfg" <<CFG
tickTime=200
initLimit=10
syncLimit=5
dataDir=$dir/data
clientPortAddress=127.0.0.1
clientPort=$port
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr,stat,mntr,conf
maxClientCnxns=0
CFG
    java -Xmx256m -cp "$zk_classpath" \
        org.apache.zookeeper.server.ZooKeeperServerMain "$dir/zoo.cfg" >"$dir/zookeeper.log" 2>&1 &
    pids+=($!)
    local i
    for i in $(seq 1 150); do
        if [ "$(timeout 1 python3 - "$port" <<'PY' 2>/dev/null
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=0.5)
s.sendall(b"ruok")
print(s.recv(16).decode(), end="")
PY
)" = "imok" ]; then
            log "ZooKeeper ready on 127.0.0.1:$port"
            return
        fi
        sleep 0.2
    done
    log "ZooKeeper did not start; its log:"; cat "$dir/zookeeper.log" >&2
    return 1
}

start_moto() {
    local port=$1 dir="$services/moto"
    rm -rf "$dir" && mkdir -p "$dir"
    "$venv/bin/moto_server" -H 127.0.0.1 -p "$port" >"$dir/moto.log" 2>&1 &
    pids+=($!)
    local i
    for i in $(seq 1 150); do
        if timeout 1 python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/', timeout=0.5)" 2>/dev/null; then
            log "S3 server (moto) ready on 127.0.0.1:$port"
            return
        fi
        sleep 0.2
    done
    log "moto did not start; its log:"; cat "$dir/moto.log" >&2
    return 1
}

