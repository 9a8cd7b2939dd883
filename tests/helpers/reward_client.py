"""Clients of ``rlhf-ext serve rm`` for tests and benchmarks: JSON requests, the in-process e_phi they must equal, and
hostile clients that speak raw HTTP over a socket (malformed chunking, one byte at a time)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

from rlhf_ext.zoo.toy import toy_preference_rows

#: |served e_phi - in-process e_phi| allowed: batching pads, which changes float rounding only.
TOLERANCE = 1e-5


def distinct_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` distinct (prompt, response) pairs of the toy task (chosen and rejected responses)."""
    pairs: dict[tuple[str, str], None] = {}
    for row in toy_preference_rows(n, seed=seed):
        pairs.setdefault((row["prompt"], row["chosen"]))
        pairs.setdefault((row["prompt"], row["rejected"]))
    assert len(pairs) >= n
    return list(pairs)[:n]


def in_process(scorer, pairs) -> list[float]:
    """e_phi of each pair on its own (no batch, no padding, no HTTP)."""
    return [scorer.score(prompt, response).evaluation for prompt, response in pairs]


def post(url: str, body: bytes, method: str = "POST", headers: dict | None = None, timeout: float = 60):
    """``(status, parsed JSON answer)`` of one request."""
    request = urllib.request.Request(url, data=body if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_json(url: str, payload: dict, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    return post(url, json.dumps(payload).encode(), headers=headers, timeout=timeout)


def reward_body(pairs: list[tuple[str, str]]) -> bytes:
    """OpenRLHF's request body for ``pairs``."""
    return json.dumps({"query": [p + r for p, r in pairs], "prompts": [p for p, _ in pairs]}).encode()


def request_head(address: tuple[str, int], length: int | None = None, chunked: bool = False) -> bytes:
    """The head of ``POST /get_reward`` with a ``Content-Length`` or chunked body, on a connection the server closes
    after its answer (``Connection: close``)."""
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (f"POST /get_reward HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\n{framing}\r\n\r\n").encode()  # fmt: skip


def read_answer(sock: socket.socket, timeout: float) -> tuple[int, dict] | None:
    """The ``(status, JSON body)`` the server sends on ``sock`` before it closes it, or None when nothing arrives
    within ``timeout`` seconds."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except TimeoutError:
        if not data:
            return None
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


class Trickler(threading.Thread):
    """A slowloris client: opens a connection, sends ``data[:start]`` at once, then the rest one byte every
    ``interval`` seconds until it is sent, the server closes the connection, or :meth:`stop`. ``sent`` counts the bytes
    sent; ``closed_after`` is the time from the first byte to the server closing the connection (None while open)."""

    def __init__(self, address: tuple[str, int], data: bytes, interval: float, start: int = 0):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(address)
        self.data, self.interval, self.start_at = data, interval, start
        self.sent = 0
        self.closed_after: float | None = None
        self.answer = b""
        self._halt = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        self.sock.settimeout(self.interval)
        try:
            self.sock.sendall(self.data[: self.start_at])
            self.sent = self.start_at
            while self.sent < len(self.data) and not self._halt.is_set():
                self.sock.sendall(self.data[self.sent : self.sent + 1])
                self.sent += 1
                try:
                    if chunk := self.sock.recv(1 << 16):  # the server answered: read to its close
                        self.answer = chunk + self._rest()
                    self.closed_after = time.monotonic() - start
                    return
                except TimeoutError:
                    pass  # the server still waits: next byte
        except OSError:  # reset by the server
            self.closed_after = time.monotonic() - start

    def _rest(self) -> bytes:
        data = b""
        self.sock.settimeout(10)
        while chunk := self.sock.recv(1 << 16):
            data += chunk
        return data

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        self.sock.close()
