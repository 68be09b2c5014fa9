#!/usr/bin/env bash
# Start a fedskew SuperLink with TLS and SuperNode authentication (the default), on the loopback.
#
#   deploy/superlink.sh [-c CERTS] [-H HOST] [-p PORT] [--insecure] [-- extra flower-superlink args]
#
#   -c CERTS    folder made by deploy/make-certs.sh (default ./certs): ca.crt superlink.pem superlink.key
#   -H HOST     address to listen on (default 127.0.0.1). Flower serves the Fleet, Control and Runtime
#               APIs on this one port, and its Control API has no user authentication: the network
#               reaches the SuperLink only through deploy/gateway.sh. Listen elsewhere only on a
#               private network whose sole entry is the gateway (as docker/compose.yml does).
#   -p PORT     the port (default 8000)
#   --insecure  plain HTTP and no node authentication: only for a trusted local network, never by default
#
# Then, on the same machine: deploy/gateway.sh -c CERTS (the public port, 8100), and register every
# SuperNode's public key once (node IDs then stay stable), from here:
#   flwr supernode register certs/node0.pub <connection to 127.0.0.1:8000>
# or from an operator's machine through deploy/control-tunnel.sh.
set -euo pipefail
CERTS=certs HOST=127.0.0.1 PORT=8000 INSECURE=0
while [ $# -gt 0 ]; do
  case $1 in
    -c) CERTS=$2; shift 2 ;; -H) HOST=$2; shift 2 ;; -p) PORT=$2; shift 2 ;;
    --insecure) INSECURE=1; shift ;; --) shift; break ;;
    *) sed -n '2,17p' "$0"; exit 2 ;;
  esac
done
. "$(dirname "$0")/_common.sh"
find_flower flower-superlink
case $HOST in
  127.* | localhost | ::1) ;;
  *) echo "superlink.sh: WARNING: listening on $HOST: whoever reaches $HOST:$PORT can use the Control API" \
       "(register nodes, run any app) and the Runtime API; keep that network private, with deploy/gateway.sh as its only way in" >&2 ;;
esac
if [ "$INSECURE" = 1 ]; then
  echo "superlink.sh: WARNING: --insecure: no TLS, no SuperNode authentication" >&2
  exec "$BIN" --insecure --host "$HOST" --port "$PORT" --disable-runtime-dependency-installation "$@"
fi
for f in ca.crt superlink.pem superlink.key; do
  [ -f "$CERTS/$f" ] || { echo "superlink.sh: $CERTS/$f missing: run deploy/make-certs.sh -o $CERTS first (or pass --insecure explicitly)" >&2; exit 1; }
done
exec "$BIN" --ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/superlink.pem" --ssl-keyfile "$CERTS/superlink.key" \
  --enable-supernode-auth --host "$HOST" --port "$PORT" --disable-runtime-dependency-installation "$@"
