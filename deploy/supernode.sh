#!/usr/bin/env bash
# Start a fedskew SuperNode that connects to the SuperLink over TLS, authenticates with its key, and
# runs only the apps installed in its trusted app store.
#
#   deploy/supernode.sh -s GATEWAY:PORT -k KEY -a STORE [-c CA] [-p PORT] [--insecure] [--cold] -- NODE-CONFIG
#
#   -s ADDR     the SuperLink's gateway, as named in its certificate's SANs, e.g. superlink.example.org:8100
#   -k KEY      this node's private key made by deploy/make-certs.sh (e.g. certs/node0); its .pub
#               must be registered first: flwr supernode register certs/node0.pub <connection>
#   -a STORE    the trusted app store made by deploy/trust-app.sh: the node runs an app only if the
#               exact FAB (same SHA-256) was installed there; any other app fails on this node
#   -c CA       the CA certificate (default: ca.crt beside KEY)
#   -p PORT     this node's local Runtime API port (default 9094; distinct per node on one host)
#   --insecure  plain HTTP, no authentication, any app: only when asked for explicitly
#   --cold      Flower's default isolation: a fresh flwr-clientapp process per message (about 2 s
#               more each). Default: a warm executor (fedskew.run.clientexec, --isolation process)
#   NODE-CONFIG e.g. 'partition-id=0 num-partitions=2 device="cuda:0" data-root="/data" cache-dir="/var/cache/fedskew"'
#
# Runs as an unprivileged user only (e.g. sudo -u fedskew deploy/supernode.sh ...): a node executes
# federated code, and the store must be read-only for that user (trust-app.sh makes it so).
# Extra flower-supernode arguments may follow NODE-CONFIG.
set -euo pipefail
SUPERLINK="" KEY="" STORE="" CA="" PORT=9094 INSECURE=0 WARM=1
while [ $# -gt 0 ]; do
  case $1 in
    -s) SUPERLINK=$2; shift 2 ;; -k) KEY=$2; shift 2 ;; -a) STORE=$2; shift 2 ;; -c) CA=$2; shift 2 ;;
    -p) PORT=$2; shift 2 ;; --insecure) INSECURE=1; shift ;; --cold) WARM=0; shift ;; --) shift; break ;;
    *) sed -n '2,21p' "$0"; exit 2 ;;
  esac
done
[ $# -ge 1 ] && [ -n "$SUPERLINK" ] || { sed -n '2,21p' "$0"; exit 2; }
NODE_CONFIG=$1
shift
. "$(dirname "$0")/_common.sh"
find_flower flower-supernode
RUNTIME=(--port "$PORT")
# warm_executor: the SuperNode (exec'd below, keeping this script's pid $$) only serves its Runtime
# API; fedskew.run.clientexec runs the ClientApps from there until the SuperNode is gone (restarted
# should it ever die).
warm_executor() {
  [ "$WARM" = 1 ] || return 0
  RUNTIME=(--isolation process --host 127.0.0.1 --port "$PORT")
  (while kill -0 $$ 2>/dev/null; do
     "$(dirname "$BIN")/python" -m fedskew.run.clientexec --runtime-api-address "127.0.0.1:$PORT" --parent-pid $$
     sleep 1
   done) &
}
if [ "$INSECURE" = 1 ]; then
  echo "supernode.sh: WARNING: --insecure: no TLS, no SuperNode authentication, any app runs" >&2
  warm_executor
  exec "$BIN" --insecure --superlink "$SUPERLINK" "${RUNTIME[@]}" --node-config "$NODE_CONFIG" "$@"
fi
[ "$(id -u)" != 0 ] || { echo "supernode.sh: refusing to run as root: run the node as an unprivileged user (e.g. sudo -u fedskew $0 ...)" >&2; exit 1; }
[ -n "$KEY" ] && [ -r "$KEY" ] || { echo "supernode.sh: -k KEY (a private key from deploy/make-certs.sh, readable by $(id -un)) is required" >&2; exit 1; }
CA=${CA:-$(dirname "$KEY")/ca.crt}
[ -r "$CA" ] || { echo "supernode.sh: CA certificate $CA missing (-c CA)" >&2; exit 1; }
check_app_store "$STORE"
FLWR_HOME=$(cd "$STORE" && pwd)   # Flower installs and loads every app under $FLWR_HOME/apps
export FLWR_HOME                  # (the warm executor's forks too)
warm_executor
exec "$BIN" --root-certificates "$CA" --superlink "$SUPERLINK" --auth-supernode-private-key "$KEY" \
  "${RUNTIME[@]}" --node-config "$NODE_CONFIG" "$@"
