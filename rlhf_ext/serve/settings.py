"""How ``rlhf-ext serve rm`` listens, batches and bounds its work: the knobs, each checked once here (the CLI and
library users get the same one-line refusal), and the listening socket, bound before the model loads."""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
from dataclasses import dataclass

#: Environment variable holding the bearer token when ``--api-key`` is not given.
API_KEY_ENV = "RLHF_EXT_API_KEY"


class SettingError(ValueError):
    """A knob out of its range: ``field`` (the :class:`ServeSettings` name; the CLI flag is ``--field-with-dashes``)
    and ``rule`` (what it must be, and the value given)."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field} {rule}")
        self.field = field
        self.rule = rule


class ServeError(Exception):
    """The server cannot listen where it was asked to (one line naming the fix)."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: What each checked knob must be: (test, the rule in words).
_RULES = {
    "port": (lambda v: _is_int(v) and 0 <= v <= 65535, "must be an integer from 0 (any free port) to 65535"),
    "max_batch_size": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "max_wait_ms": (lambda v: _is_finite(v) and v >= 0, "must be a finite number >= 0"),
    "max_request_pairs": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "max_body_bytes": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "workers": (lambda v: _is_int(v) and 1 <= v <= 256, "must be an integer from 1 to 256"),
    "max_pending": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "max_length": (lambda v: v is None or (_is_int(v) and v >= 2), "must be an integer >= 2"),
    "read_timeout_s": (lambda v: _is_finite(v) and v > 0, "must be a finite number > 0"),
    "request_timeout_s": (lambda v: _is_finite(v) and v > 0, "must be a finite number > 0"),
    "api_key": (lambda v: v is None or (isinstance(v, str) and v.strip() != "" and v.isprintable()),
                "must be non-empty printable text"),
}  # fmt: skip


@dataclass(frozen=True)
class ServeSettings:
    """How the server listens, batches and bounds its work.

    Args:
        host, port: where to listen (``port=0``: a free port, see :attr:`RewardServer.url`). A host other than a
            loopback address needs ``api_key`` (or ``insecure=True``).
        max_batch_size: pairs scored in one forward pass of each model.
        max_wait_ms: how long the first pair of a batch waits for more pairs; 0 (default): a batch closes as soon as
            no other pair is waiting.
        max_request_pairs: pairs one request may carry (413 above it).
        max_body_bytes: size of one request body (413 above it).
        workers: threads that parse and tokenise request bodies.
        max_pending: open connections beyond which a request is answered 503 at once.
        max_length: tokens per prompt + response (prompts cut from the left, responses from the right, as in
            training); default: the reward model's ``max_position_embeddings``.
        read_timeout_s: a request's head, then its body, must each arrive within this many seconds (else 408).
        request_timeout_s: how long a request waits for its scores before a 503.
        api_key: the bearer token every scoring request must carry (``Authorization: Bearer KEY``, or HTTP basic auth
            with KEY as the password, as OpenRLHF sends for ``http://user:KEY@host/get_reward``); None: no auth.
        insecure: allow a non-loopback ``host`` without ``api_key``.
    """

    host: str = "127.0.0.1"
    port: int = 5000
    max_batch_size: int = 32
    max_wait_ms: float = 0.0
    max_request_pairs: int = 256
    max_body_bytes: int = 16 * 1024 * 1024
    workers: int = 2
    max_pending: int = 1024
    max_length: int | None = None
    read_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    api_key: str | None = None
    insecure: bool = False

    def __post_init__(self):
        for name, (test, rule) in _RULES.items():
            value = getattr(self, name)
            if not test(value):
                raise SettingError(name, f"{rule}, got {'(hidden)' if name == 'api_key' else repr(value)}")
        if not self.api_key and not self.insecure and not is_loopback(self.host):
            raise SettingError(
                "host", f"is {self.host!r}, reachable from other machines: give an api_key (--api-key or "
                f"{API_KEY_ENV}) so that only clients holding it are served, or pass --insecure to serve anyone"
            )  # fmt: skip


def _addresses(host: str, port: int | None) -> list[tuple]:
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise ServeError(
            f"cannot listen on host {host!r}: it resolves to no address; give an address or name of this machine"
        ) from None


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (reachable from this machine only).

    Raises:
        ServeError: ``host`` does not resolve.
    """
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in _addresses(host, None))


def bind_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port`` (the first address ``host`` resolves to).

    Raises:
        ServeError: one line naming the cause and the fix (port in use, address not of this machine, a privileged
            port, an unknown host name).
    """
    family, kind, proto, _, address = _addresses(host, port)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        where = f"{host}:{port}"
        fixes = {
            errno.EADDRINUSE: f"{where} is in use: pick another --port (0: any free one) or stop the server holding it",
            errno.EACCES: f"no permission to listen on {where}: pick a --port above 1023 (0: any free one)",
            errno.EADDRNOTAVAIL: f"cannot listen on {where}: {host} is not an address of this machine; give one of "
            "its addresses (127.0.0.1: this machine only, 0.0.0.0: all)",
        }
        raise ServeError(fixes.get(e.errno, f"cannot listen on {where}: {e.strerror or e}")) from None
    sock.setblocking(False)
    return sock
