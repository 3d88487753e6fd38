#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need that cargo does not, then
# runs every test of the workspace. Doc tests run first so the last line is the runner's count.
set -euo pipefail
cd "$(dirname "$0")/.."

# The NATS tests run against a real nats-server (2.12 or newer) that each test starts itself.
NATS_SERVER_BIN="$(bash ops/nats-server.sh)"
export NATS_SERVER_BIN
echo "using $NATS_SERVER_BIN ($("$NATS_SERVER_BIN" --version))"

# The dashboard's test drives a real browser: Debian's chromium, installed when missing.
if [ -z "${CHROMIUM_BIN:-}" ] && ! command -v chromium >/dev/null 2>&1; then
    echo "installing chromium for the dashboard's browser test"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
echo "using $(command -v "${CHROMIUM_BIN:-chromium}") ($("${CHROMIUM_BIN:-chromium}" --version 2>/dev/null))"

cargo test --workspace --doc
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast
else
    cargo test --workspace --no-fail-fast
fi
