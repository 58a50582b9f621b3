#!/usr/bin/env python3
"""Clients for the hostile-neighbour tests, run as another user (the test sets the uid).

  hostile_clients.py stall SOCKET N SECONDS
      opens N connections, each sending a POST's headers and one byte of its body, holds
      them SECONDS, and prints {"held": h, "refused": r, "codes": {...}}: a connection
      counts as refused when gpud answered it at once (429) and closed it.
  hostile_clients.py churn SOCKET SECONDS
      reserves 1 MiB with a lease and releases it, over and over for SECONDS on one
      connection, and prints {"statuses": {...}} of every reply.
  hostile_clients.py health SOCKET COUNT
      sends COUNT `GET /v1/health` one after another, each on a new connection, and prints
      {"statuses": {...}, "p50_ms": x, "p99_ms": y, "max_ms": z}.
"""
import json
import select
import socket
import sys
import time


def stall(path, n, seconds):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(b"POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Length: 100\r\n\r\n{")
        socks.append(s)
    # A refused connection is answered at once; a held one stays silent.
    time.sleep(1.0)
    codes, refused, held = {}, [], []
    for s in socks:
        ready, _, _ = select.select([s], [], [], 0)
        if ready:
            data = s.recv(65536)
            code = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
            codes[code] = codes.get(code, 0) + 1
            refused.append(s)
        else:
            held.append(s)
    print(json.dumps({"held": len(held), "refused": len(refused), "codes": codes}), flush=True)
    time.sleep(seconds)


def request(s, method, route, body=b""):
    """One request on a keep-alive connection; returns (status, body)."""
    head = f"{method} {route} HTTP/1.1\r\nHost: gpud\r\nContent-Length: {len(body)}\r\n\r\n"
    s.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    header, rest = data.split(b"\r\n\r\n", 1)
    length = 0
    for line in header.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        rest += s.recv(65536)
    return header.split(b" ", 2)[1].decode(), rest


def churn(path, seconds):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    statuses = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        code, body = request(s, "POST", "/v1/reservations", b'{"memory": "1MiB", "ttl_seconds": 600}')
        statuses[code] = statuses.get(code, 0) + 1
        if code == "201":
            rid = json.loads(body)["id"]
            code, _ = request(s, "DELETE", f"/v1/reservations/{rid}")
            statuses[code] = statuses.get(code, 0) + 1
    print(json.dumps({"statuses": statuses}), flush=True)


def health(path, count):
    statuses, times = {}, []
    for _ in range(count):
        start = time.monotonic()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        data = b""
        try:
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\n\r\n")
        except OSError:
            pass  # answered and closed before the request went out: read the answer
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        s.close()
        times.append((time.monotonic() - start) * 1000)
        code = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
        statuses[code] = statuses.get(code, 0) + 1
    times.sort()
    pick = lambda q: round(times[min(len(times) - 1, int(q * len(times)))], 2)
    print(json.dumps({"statuses": statuses, "p50_ms": pick(0.5), "p99_ms": pick(0.99),
                      "max_ms": round(times[-1], 2)}), flush=True)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "stall":
        stall(path, int(sys.argv[3]), float(sys.argv[4]))
    elif mode == "churn":
        churn(path, float(sys.argv[3]))
    elif mode == "health":
        health(path, int(sys.argv[3]))
    else:
        sys.exit(f"unknown mode {mode}")
