# Sourced by superlink.sh / supernode.sh: Flower's offline settings and where its binaries are.
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

# find_flower NAME: the NAME executable on PATH, else in this checkout's .venv; puts its folder first
# on PATH so that flower-superexec / flwr-serverapp / flwr-clientapp next to it are found too.
find_flower() {
  BIN=$(command -v "$1" || true)
  [ -n "$BIN" ] || BIN="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/$1"
  export PATH="$(dirname "$BIN"):$PATH"
}

# ---- nginx: the gateway (gateway.sh) and the operator's tunnel (control-tunnel.sh) ----------------
need_nginx() {
  NGINX=$(command -v nginx || true)
  [ -n "$NGINX" ] || [ ! -x /usr/sbin/nginx ] || NGINX=/usr/sbin/nginx
  [ -n "$NGINX" ] || { echo "$(basename "$0"): nginx is required (Debian: apt-get install nginx-light)" >&2; exit 1; }
}

# nginx_preamble RUN: the main and events sections and the http settings both configs share; every
# file nginx writes stays in RUN. As root, the workers run as nobody.
nginx_preamble() {
  local user=""
  [ "$(id -u)" != 0 ] || user="user nobody $(id -gn nobody 2>/dev/null || echo nogroup);"
  cat <<CONF
daemon off;
worker_processes 1;
pid $1/nginx.pid;
error_log stderr notice;
$user
events { worker_connections 512; }
CONF
}

# nginx_http_paths RUN: temporary-file paths for an http section, inside RUN.
nginx_http_paths() {
  local p
  for p in client_body proxy fastcgi uwsgi scgi; do echo "  ${p}_temp_path $1/$p;"; done
}

# nginx_proxy_to URL CA NAME: the directives that pass a location on to URL over TLS, checking its
# certificate against CA and NAME; streaming (flwr log --stream) and large bodies pass unbuffered.
nginx_proxy_to() {
  echo "proxy_pass $1; proxy_http_version 1.1; proxy_set_header Connection \"\";" \
    "proxy_buffering off; proxy_request_buffering off; proxy_read_timeout 1h; proxy_send_timeout 1h;" \
    "proxy_ssl_verify on; proxy_ssl_verify_depth 1; proxy_ssl_trusted_certificate $2;" \
    "proxy_ssl_name $3; proxy_ssl_server_name on; proxy_ssl_protocols TLSv1.2 TLSv1.3;"
}

# run_nginx RUN: check RUN/nginx.conf, run nginx in the foreground until it ends or this script is
# stopped (then nginx is stopped too), and remove RUN.
run_nginx() {
  local run=$1
  chmod 755 "$run"
  trap 'kill -TERM $NGINX_PID 2>/dev/null || true; wait $NGINX_PID 2>/dev/null || true; rm -rf "$run"' EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  NGINX_PID=""
  "$NGINX" -t -q -p "$run/" -c "$run/nginx.conf" -e stderr
  "$NGINX" -p "$run/" -c "$run/nginx.conf" -e stderr &
  NGINX_PID=$!
  wait "$NGINX_PID"
}

# ---- the trusted app store of a node (trust-app.sh fills it, supernode.sh checks it) -------------
# A store is a FLWR_HOME: Flower installs the FAB of every run under $FLWR_HOME/apps/<publisher>.
# <name>.<version>.<hash> and loads it from there, and skips the install when that folder exists.
# With the store read-only for the node's user, the node runs exactly the FABs installed here;
# any other FAB fails to install, so none of its code runs.
check_app_store() {
  local store=$1 me
  me=$(basename "$0")
  [ -n "$store" ] || { echo "$me: -a STORE (the trusted app store made by deploy/trust-app.sh) is required" >&2; exit 1; }
  compgen -G "$store/apps/*/pyproject.toml" >/dev/null ||
    { echo "$me: no trusted app in $store: install one first with deploy/trust-app.sh -s $store FAB" >&2; exit 1; }
  if [ -n "$(find "$store" -writable -print -quit)" ]; then
    echo "$me: the app store $store is writable by $(id -un), so it would accept any app:" \
      "make it read-only for this user (deploy/trust-app.sh does)" >&2
    exit 1
  fi
  echo "$me: trusted apps: $(cd "$store/apps" && echo *)"
}
