#!/usr/bin/env bash
# Start a fedskew SuperLink with TLS and SuperNode authentication (the default).
#
#   deploy/superlink.sh [-c CERTS] [-H HOST] [-p PORT] [--insecure] [-- extra flower-superlink args]
#
#   -c CERTS    folder made by deploy/make-certs.sh (default ./certs): ca.crt superlink.pem superlink.key
#   -H HOST     address to listen on (default 0.0.0.0: reachable from other machines)
#   -p PORT     the SuperLink's one HTTP(S) port: Fleet, Control and Runtime API (default 8100)
#   --insecure  plain HTTP and no node authentication: only for a trusted local network, never by default
#
# After it runs, register every SuperNode's public key once (node IDs then stay stable):
#   flwr supernode register certs/node0.pub <connection>
set -euo pipefail
CERTS=certs HOST=0.0.0.0 PORT=8100 INSECURE=0
while [ $# -gt 0 ]; do
  case $1 in
    -c) CERTS=$2; shift 2 ;; -H) HOST=$2; shift 2 ;; -p) PORT=$2; shift 2 ;;
    --insecure) INSECURE=1; shift ;; --) shift; break ;;
    *) sed -n '2,13p' "$0"; exit 2 ;;
  esac
done
. "$(dirname "$0")/_common.sh"
find_flower flower-superlink
if [ "$INSECURE" = 1 ]; then
  echo "superlink.sh: WARNING: --insecure: no TLS, no SuperNode authentication" >&2
  exec "$BIN" --insecure --host "$HOST" --port "$PORT" --disable-runtime-dependency-installation "$@"
fi
for f in ca.crt superlink.pem superlink.key; do
  [ -f "$CERTS/$f" ] || { echo "superlink.sh: $CERTS/$f missing: run deploy/make-certs.sh -o $CERTS first (or pass --insecure explicitly)" >&2; exit 1; }
done
exec "$BIN" --ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/superlink.pem" --ssl-keyfile "$CERTS/superlink.key" \
  --enable-supernode-auth --host "$HOST" --port "$PORT" --disable-runtime-dependency-installation "$@"
