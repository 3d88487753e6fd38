#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need that cargo does not, then
# runs every test of the workspace. Doc tests run first so the last line is the runner's count.
set -euo pipefail
cd "$(dirname "$0")/.."

# The NATS tests run against a real nats-server (2.12 or newer) that each test starts itself.
NATS_SERVER_BIN="$(bash ops/nats-server.sh)"
export NATS_SERVER_BIN
echo "using $NATS_SERVER_BIN ($("$NATS_SERVER_BIN" --version))"

cargo test --workspace --doc
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast
else
    cargo test --workspace --no-fail-fast
fi
