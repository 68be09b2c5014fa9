#!/usr/bin/env bash
# The SuperLink's public door: nginx terminates TLS on the public port and passes on only
#   /v1/fleet/...    to everyone (every Fleet call is then checked by Flower's SuperNode
#                    authentication: only registered node keys get anything);
#   /v1/control/...  only to a client presenting an operator certificate from make-certs.sh
#                    (Flower's open-source Control API has no user authentication of its own);
#   /health          to everyone;
# and refuses everything else (the Runtime API, through which a ServerApp process talks to the
# SuperLink, must never be reachable from the network).
#
#   deploy/gateway.sh [-c CERTS] [-H HOST] [-p PORT] [-u UPSTREAM] [-n NAME]
#
#   -c CERTS     folder made by deploy/make-certs.sh (default ./certs): ca.crt superlink.pem superlink.key
#   -H HOST      address to listen on (default 0.0.0.0)
#   -p PORT      the public port that SuperNodes and operators connect to (default 8100)
#   -u UPSTREAM  the SuperLink started by deploy/superlink.sh (default 127.0.0.1:8000)
#   -n NAME      the name its certificate is checked against (default localhost)
#
# Needs nginx (Debian: apt-get install nginx-light). Runs in the foreground; Ctrl-C stops it.
set -euo pipefail
CERTS=certs HOST=0.0.0.0 PORT=8100 UPSTREAM=127.0.0.1:8000 NAME=localhost
while getopts "c:H:p:u:n:h" opt; do
  case $opt in
    c) CERTS=$OPTARG ;; H) HOST=$OPTARG ;; p) PORT=$OPTARG ;; u) UPSTREAM=$OPTARG ;; n) NAME=$OPTARG ;;
    *) sed -n '2,19p' "$0"; exit 2 ;;
  esac
done
. "$(dirname "$0")/_common.sh"
need_nginx
CERTS=$(cd "$CERTS" 2>/dev/null && pwd) || { echo "gateway.sh: no folder $CERTS: run deploy/make-certs.sh first" >&2; exit 1; }
for f in ca.crt superlink.pem superlink.key; do
  [ -r "$CERTS/$f" ] || { echo "gateway.sh: $CERTS/$f missing or unreadable: run deploy/make-certs.sh -o $CERTS first" >&2; exit 1; }
done

RUN=$(mktemp -d "${TMPDIR:-/tmp}/fedskew-gateway.XXXXXX")
cat >"$RUN/nginx.conf" <<CONF
$(nginx_preamble "$RUN")
http {
$(nginx_http_paths "$RUN")
  # log every refusal and every Control API call, not the SuperNodes' routine polling
  log_format gateway '\$remote_addr "\$request" \$status operator="\$ssl_client_s_dn"';
  map "\$status \$uri" \$gateway_log { "~^2\d\d /v1/fleet/" 0; default 1; }
  access_log /dev/stdout gateway if=\$gateway_log;
  client_max_body_size 64m;     # a FAB is at most 10 MB, message objects come in 5 MB chunks

  server {
    listen $HOST:$PORT ssl;
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_certificate $CERTS/superlink.pem;
    ssl_certificate_key $CERTS/superlink.key;
    # operators prove themselves with a client certificate signed by our CA (clientAuth only:
    # the server certificate is not accepted as one); SuperNodes present none
    ssl_client_certificate $CERTS/ca.crt;
    ssl_verify_client optional;
    ssl_verify_depth 1;

    location /v1/fleet/ { $(nginx_proxy_to "https://$UPSTREAM" "$CERTS/ca.crt" "$NAME") }
    location = /health { $(nginx_proxy_to "https://$UPSTREAM" "$CERTS/ca.crt" "$NAME") }
    location /v1/control/ {
      if (\$ssl_client_verify != SUCCESS) { return 403; }
      $(nginx_proxy_to "https://$UPSTREAM" "$CERTS/ca.crt" "$NAME")
    }
    location / { return 403; }
  }
}
CONF
echo "gateway.sh: https://$HOST:$PORT -> SuperLink $UPSTREAM (Fleet API: registered nodes; Control API: operator certificates)"
run_nginx "$RUN"
