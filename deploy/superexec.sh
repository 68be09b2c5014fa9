#!/usr/bin/env bash
# Run a ServerApp or a SuperNode's ClientApps in processes of their own (Flower's process isolation,
# `--isolation process` on the SuperLink / SuperNode): this SuperExec takes the tasks of the Runtime
# API it is given and runs each in a fresh process, loading apps from the trusted app store only.
#
#   deploy/superexec.sh -r ADDRESS -a STORE [-c CA] [-s SECRET]
#
#   -r ADDRESS  the Runtime API: the SuperLink's (e.g. superlink:8000) or a SuperNode's (supernode-0:9094)
#   -a STORE    the trusted app store made by deploy/trust-app.sh (read-only for this user)
#   -c CA       check the Runtime API's TLS certificate with CA (the SuperLink's); without -c, plain
#               HTTP (a SuperNode's Runtime API, on a private network shared with this process only)
#   -s SECRET   the shared secret file also given to the SuperLink / SuperNode
#               (--superexec-auth-secret-file): only a SuperExec holding it may take tasks
# Runs as an unprivileged user only.
set -euo pipefail
ADDRESS="" STORE="" CA="" SECRET=""
while getopts "r:a:c:s:h" opt; do
  case $opt in
    r) ADDRESS=$OPTARG ;; a) STORE=$OPTARG ;; c) CA=$OPTARG ;; s) SECRET=$OPTARG ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
  esac
done
[ -n "$ADDRESS" ] || { sed -n '2,14p' "$0"; exit 2; }
. "$(dirname "$0")/_common.sh"
find_flower flower-superexec
[ "$(id -u)" != 0 ] || { echo "superexec.sh: refusing to run as root: apps run here; use an unprivileged user" >&2; exit 1; }
check_app_store "$STORE"
FLWR_HOME=$(cd "$STORE" && pwd)
export FLWR_HOME
args=(--runtime-api-address "$ADDRESS")
if [ -n "$CA" ]; then args+=(--root-certificates "$CA"); else args+=(--insecure); fi
[ -z "$SECRET" ] || args+=(--superexec-auth-secret-file "$SECRET")
exec "$BIN" "${args[@]}"
