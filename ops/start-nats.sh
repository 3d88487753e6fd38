#!/usr/bin/env bash
# Starts a local nats-server for fairledger in the foreground, installing one (2.12 or newer)
# if needed. `bash ops/start-nats.sh` (fsync every two minutes), `bash ops/start-nats.sh strict`
# (fsync every write) or `bash ops/start-nats.sh secure` (a NATS user per role: first run
# `fairledger nats-auth --out ops/nats --agent NODE...`). Data goes to ./nats-data. Then:
# fairledger ... --nats nats://127.0.0.1:4222 (with secure: --nats-nkey ops/nats/fairledger.nk)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-single}"
case "$mode" in
    single|strict) ;;
    secure)
        if [ ! -f "$here/nats/users.conf" ]; then
            echo "no ops/nats/users.conf: run \`fairledger nats-auth --out ops/nats --agent NODE\` first" >&2
            exit 2
        fi ;;
    *) echo "usage: $0 [single|strict|secure]" >&2; exit 2 ;;
esac
bin="$(bash "$here/nats-server.sh")"
exec "$bin" -c "$here/nats/$mode.conf"
