#!/usr/bin/env bash
# Starts a local nats-server for fairledger in the foreground, installing one (2.12 or newer)
# if needed. `bash ops/start-nats.sh` (fsync every two minutes) or `bash ops/start-nats.sh strict`
# (fsync every write). Data goes to ./nats-data. Then: fairledger ... --nats nats://127.0.0.1:4222
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-single}"
case "$mode" in
    single|strict) ;;
    *) echo "usage: $0 [single|strict]" >&2; exit 2 ;;
esac
bin="$(bash "$here/nats-server.sh")"
exec "$bin" -c "$here/nats/$mode.conf"
