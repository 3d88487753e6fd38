#!/usr/bin/env python3
"""Recomputes the fairledger log's chain of heads from a copy of its events.

Reads one event per line, in log order (a `fairledger log export`, or the payloads of the
`LEDGER` stream's messages as a subscriber receives them from sequence 1), and prints the head
after the last one, or after sequence --at, as SEQ:HASH:

    h_0 = 32 zero bytes
    h_n = SHA-256(h_{n-1} || canonical(event_n))

canonical is RFC 8785 (JCS): object keys sorted by their UTF-16 code units, no whitespace,
strings escaped as JSON requires and no more, numbers as ECMAScript writes them. A line that is
not JSON is hashed as its bytes. Only the standard library is used.

    python3 chain_head.py events.jsonl             # the head after the last event
    python3 chain_head.py --at 1200 events.jsonl   # the head after event 1200
"""

import argparse
import hashlib
import json
import math
import sys


def number(x):
    """A JSON number as ECMAScript's Number.prototype.toString writes it."""
    if isinstance(x, bool):
        raise TypeError("not a number")
    if isinstance(x, int):
        if abs(x) < 2**53:
            return str(x)
        x = float(x)  # as ECMAScript reads it: the nearest double
    if not math.isfinite(x):
        raise ValueError("JSON has no NaN or infinity")
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    # The shortest digits that read back as x, placed as ECMAScript places them.
    r = repr(abs(x))
    digits, exponent = r.split("e") if "e" in r else (r, "0")
    mantissa = digits.replace(".", "")
    point = digits.index(".") if "." in digits else len(digits)
    n = point + int(exponent)  # where the decimal point falls in the digits
    stripped = mantissa.lstrip("0")
    n -= len(mantissa) - len(stripped)
    mantissa = stripped.rstrip("0") or "0"
    k = len(mantissa)
    sign = "-" if x < 0 else ""
    if k <= n <= 21:
        return sign + mantissa + "0" * (n - k)
    if 0 < n <= 21:
        return sign + mantissa[:n] + "." + mantissa[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + mantissa
    e = n - 1
    tail = ("." + mantissa[1:]) if k > 1 else ""
    return sign + mantissa[0] + tail + "e" + ("+" if e > 0 else "-") + str(abs(e))


def canonical(value):
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (int, float)):
        return number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + canonical(value[k]) for k in keys) + "}"
    raise TypeError(f"not JSON: {value!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("events", nargs="?", help="JSON lines, one event each (stdin if absent)")
    parser.add_argument("--at", type=int, help="print the head after this sequence")
    args = parser.parse_args()
    source = open(args.events, "rb") if args.events else sys.stdin.buffer
    head, seq = bytes(32), 0
    for line in source:
        # One event a line, whatever it holds: an empty payload is chained as its (no) bytes.
        line = line[:-1] if line.endswith(b"\n") else line
        if args.at is not None and seq == args.at:
            break
        try:
            data = canonical(json.loads(line)).encode("utf-8")
        except ValueError:
            data = line
        head = hashlib.sha256(head + data).digest()
        seq += 1
    if args.at is not None and seq < args.at:
        sys.exit(f"the events end at sequence {seq}, before {args.at}")
    print(f"{seq}:{head.hex()}")


if __name__ == "__main__":
    main()
