#!/usr/bin/env bash
# An operator's way in to the Control API from another machine: the `flwr` CLI cannot present a
# client certificate, so this local nginx does it for the CLI. It listens on the loopback only and
# forwards every call over TLS to the gateway (deploy/gateway.sh), with the operator certificate.
#
#   deploy/control-tunnel.sh -s GATEWAY:PORT -k CERT [-c CA] [-l LISTEN]
#
#   -s GATEWAY:PORT  the gateway, as named in its certificate's SANs, e.g. superlink.example.org:8100
#   -k CERT          the operator certificate made by deploy/make-certs.sh -a NAME, without suffix:
#                    CERT.crt and CERT.key (e.g. certs/admin)
#   -c CA            the CA certificate (default: ca.crt beside CERT)
#   -l LISTEN        the local address the CLI connects to (default 127.0.0.1:8101)
#
# The CLI's connection then reads (plain HTTP, loopback only):
#   [superlink.prod]
#   address = "127.0.0.1:8101"
#   insecure = true
# Anyone who can open connections on this machine's loopback can use the tunnel while it runs:
# stop it (Ctrl-C) when done. Needs nginx (Debian: apt-get install nginx-light).
set -euo pipefail
GATEWAY="" CERT="" CA="" LISTEN=127.0.0.1:8101
while getopts "s:k:c:l:h" opt; do
  case $opt in
    s) GATEWAY=$OPTARG ;; k) CERT=$OPTARG ;; c) CA=$OPTARG ;; l) LISTEN=$OPTARG ;;
    *) sed -n '2,19p' "$0"; exit 2 ;;
  esac
done
[ -n "$GATEWAY" ] && [ -n "$CERT" ] || { sed -n '2,19p' "$0"; exit 2; }
. "$(dirname "$0")/_common.sh"
need_nginx
CA=${CA:-$(dirname "$CERT")/ca.crt}
for f in "$CERT.crt" "$CERT.key" "$CA"; do
  [ -r "$f" ] || { echo "control-tunnel.sh: $f missing or unreadable (deploy/make-certs.sh -a NAME makes operator certificates)" >&2; exit 1; }
done
case $LISTEN in
  127.* | localhost:* | \[::1\]:*) ;;
  *) echo "control-tunnel.sh: -l $LISTEN: the tunnel must listen on the loopback only" >&2; exit 1 ;;
esac
abs() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }

RUN=$(mktemp -d "${TMPDIR:-/tmp}/fedskew-tunnel.XXXXXX")
cat >"$RUN/nginx.conf" <<CONF
$(nginx_preamble "$RUN")
http {
$(nginx_http_paths "$RUN")
  access_log off;
  client_max_body_size 64m;
  server {
    listen $LISTEN;
    location / {
      $(nginx_proxy_to "https://$GATEWAY" "$(abs "$CA")" "${GATEWAY%:*}")
      proxy_ssl_certificate $(abs "$CERT.crt");
      proxy_ssl_certificate_key $(abs "$CERT.key");
    }
  }
}
CONF
echo "control-tunnel.sh: http://$LISTEN -> https://$GATEWAY as $(openssl x509 -in "$CERT.crt" -noout -subject 2>/dev/null || echo "$CERT.crt")"
run_nginx "$RUN"
