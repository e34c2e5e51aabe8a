#!/usr/bin/env bash
# Start or stop `lora-cache serve` on the Ray head node; the cluster configs run it after `ray start --head`.
#
#   deploy/start-service.sh start [lora-cache serve options...]   # joins the local cluster (--address auto)
#   deploy/start-service.sh stop                                   # Ctrl-C to it, then SIGKILL after 30 s
#   deploy/start-service.sh tls                                    # the gateway's TLS pair, made if absent
#
# `tls` keeps a certificate and key the operator put at $LORA_CACHE_HOME/tls/gateway.{crt,key} (a file mount of
# the cluster config); otherwise it makes a self-signed pair there once (P-256, 10 years, the head's addresses
# and host name as SANs), which later runs keep. Routers trust gateway.crt: copy it from the head
# (`ray rsync-down CONFIG ~/.lora-cache/tls/gateway.crt gateway.crt`) and give it as --tls-ca.
#
# `start` detaches the service from the SSH session that `ray up` runs it in, and returns once it has joined
# the Ray cluster (or fails with the end of its log). The replicas are placed after that, as GPU nodes join:
# give --placement-timeout-s long enough for the autoscaler to launch them. Log and pid file:
# $LORA_CACHE_HOME (default ~/.lora-cache)/serve.log and serve.pid. Ray's token auth comes from the environment
# (RAY_AUTH_MODE, and the token in ~/.ray/auth_token), as for every Ray process on the node.
set -euo pipefail

home="${LORA_CACHE_HOME:-$HOME/.lora-cache}"
log="$home/serve.log"
pidfile="$home/serve.pid"
join_timeout_s="${LORA_CACHE_JOIN_TIMEOUT_S:-120}"

# a live process (an exited one that nobody reaped yet is a zombie: gone)
alive() { kill -0 "$1" 2>/dev/null && [[ "$(ps -o stat= -p "$1" 2>/dev/null)" != Z* ]]; }
running() { [[ -f "$pidfile" ]] && alive "$(cat "$pidfile")"; }

stop() {
  running || { rm -f "$pidfile"; return 0; }
  local pid; pid="$(cat "$pidfile")"
  kill -INT "$pid"
  for _ in $(seq 30); do alive "$pid" || break; sleep 1; done
  if alive "$pid"; then
    echo "lora-cache serve (pid $pid) did not stop within 30 s of Ctrl-C; killing it" >&2
    kill -KILL "$pid"
  fi
  rm -f "$pidfile"
  echo "lora-cache serve stopped"
}

start() {
  stop
  mkdir -p "$home"
  : > "$log"
  # a new session: the service outlives the SSH command; $$ of the inner shell is the service's pid (exec)
  setsid bash -c 'echo $$ > "$1"; shift; exec lora-cache serve --address auto "$@"' _ "$pidfile" "$@" \
    > "$log" 2>&1 < /dev/null &
  local why="did not join the Ray cluster within $join_timeout_s s"
  for _ in $(seq "$join_timeout_s"); do
    if grep -q "lora-cache: joined the Ray cluster" "$log"; then
      grep "lora-cache" "$log" | tail -n 3
      echo "lora-cache serve is running (pid $(cat "$pidfile")); replicas start as nodes join: tail -f $log"
      return 0
    fi
    if [[ -f "$pidfile" ]] && ! running; then why="exited before joining the Ray cluster"; break; fi
    sleep 1
  done
  echo "lora-cache serve $why; the end of $log:" >&2
  tail -n 40 "$log" >&2
  if running; then kill -KILL "$(cat "$pidfile")"; fi
  rm -f "$pidfile"
  return 1
}

tls() {
  local dir="$home/tls"
  if [[ -s "$dir/gateway.crt" && -s "$dir/gateway.key" ]]; then
    echo "lora-cache gateway TLS: keeping $dir/gateway.crt"
    return 0
  fi
  mkdir -p "$dir" && chmod 700 "$dir"
  local sans="DNS:localhost,DNS:$(hostname),IP:127.0.0.1" ip
  for ip in $(hostname -I 2>/dev/null); do sans="$sans,IP:$ip"; done
  (umask 077 && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
    -subj "/CN=lora-cache-gateway" -addext "subjectAltName=$sans" \
    -keyout "$dir/gateway.key" -out "$dir/gateway.crt")
  chmod 644 "$dir/gateway.crt"  # the certificate is public; the key stays the owner's alone
  echo "lora-cache gateway TLS: made a self-signed $dir/gateway.crt ($sans); routers trust it (--tls-ca)"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop ;;
  tls) tls ;;
  *) echo "usage: $0 start [lora-cache serve options...] | stop | tls" >&2; exit 2 ;;
esac
