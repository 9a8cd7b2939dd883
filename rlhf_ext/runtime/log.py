"""rlhf-ext's library logger: ``logging.getLogger("rlhf_ext")``, with one logger per module underneath it.

Library modules log through ``logging.getLogger(__name__)`` and never print, add handlers or touch the root logger
(no ``NullHandler``, as in transformers). A host application controls rlhf-ext's output like any library's::

    logging.getLogger("rlhf_ext").setLevel(logging.WARNING)      # warnings and errors only

The command line calls :func:`configure_cli_output` (one stream handler at ``INFO`` unless the host configured logging;
``RLHF_EXT_VERBOSITY=debug|info|warning|error`` sets the level); a script calls :func:`enable_console_logging`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import TextIO

#: The name of the library's top logger; every module logger (``rlhf_ext.x.y``) propagates to it.
LIBRARY_LOGGER = "rlhf_ext"
#: The environment variable that sets the library logger's level under the command line.
VERBOSITY_ENV = "RLHF_EXT_VERBOSITY"
VERBOSITY_LEVELS: dict[str, int] = {n: getattr(logging, n.upper()) for n in ("debug", "info", "warning", "error")}
#: Environment variables that turn off the progress bars of the Hugging Face libraries (their bars redraw a line
#: with ``\r``, which a pipe or a log file records as one ever-growing line).
HF_PROGRESS_BAR_SWITCHES = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")

logger = logging.getLogger(__name__)


def library_logger() -> logging.Logger:
    """The ``rlhf_ext`` logger (the parent of every module logger of the package)."""
    return logging.getLogger(LIBRARY_LOGGER)


def parse_verbosity(value: str | int) -> int:
    """A logging level from ``debug|info|warning|error`` (any case) or a level number (``ValueError`` otherwise)."""
    if isinstance(value, int):
        return value
    level = VERBOSITY_LEVELS.get(value.strip().lower())
    if level is None:
        raise ValueError(f"unknown verbosity {value!r}: use one of {', '.join(VERBOSITY_LEVELS)}")
    return level


def verbosity_from_env() -> int | None:
    """The level ``RLHF_EXT_VERBOSITY`` asks for, or ``None`` when it is unset or empty. An unknown value is
    reported (one warning) and ignored."""
    value = os.environ.get(VERBOSITY_ENV, "").strip()
    if not value:
        return None
    try:
        return parse_verbosity(value)
    except ValueError as error:
        logger.warning("%s: %s; ignored", VERBOSITY_ENV, error)
        return None


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` is an interactive terminal (progress bars are drawn only there)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class ConsoleFormatter(logging.Formatter):
    """Info and debug lines as they are; warnings and errors prefixed with their level (``warning: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


class ConsoleHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is at the time of each record (so it survives
    redirections such as click's test runner), above any tqdm progress bar drawn on it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(ConsoleFormatter())

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns it; the current stderr wins
        pass

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        bars = tqdm is not None and getattr(tqdm.tqdm, "_instances", None)  # a bar is on screen
        with tqdm.tqdm.external_write_mode(file=sys.stderr) if bars else contextlib.nullcontext():  # clears, redraws
            super().emit(record)


def enable_console_logging(level: str | int | None = None) -> logging.Handler:
    """Show rlhf-ext's log lines on stderr, as the command line does: one :class:`ConsoleHandler` on the
    ``rlhf_ext`` logger (added once; a second call only changes the level), returned. ``level``:
    ``debug|info|warning|error`` or a level number; ``None``: ``RLHF_EXT_VERBOSITY``, else ``info``."""
    log = library_logger()
    handler = next((h for h in log.handlers if isinstance(h, ConsoleHandler)), None)
    if handler is None:
        handler = ConsoleHandler()
        log.addHandler(handler)
    log.setLevel(parse_verbosity(level) if level is not None else verbosity_from_env() or logging.INFO)
    return handler


def host_configured_logging() -> bool:
    """Whether the program configured logging for rlhf-ext already: a handler on the ``rlhf_ext`` logger or on the
    root logger, or a level set on the ``rlhf_ext`` logger."""
    log = library_logger()
    return bool(log.handlers or log.level != logging.NOTSET or logging.getLogger().handlers)


def configure_cli_output() -> None:
    """The command line's terminal set-up, called once by each entry point before any work: unless
    :func:`host_configured_logging`, :func:`enable_console_logging` (else only an explicit ``RLHF_EXT_VERBOSITY``
    applies); when stderr is not a terminal, the Hugging Face libraries' progress bars are turned off
    (:data:`HF_PROGRESS_BAR_SWITCHES`, unless the environment sets them)."""
    # TRL 1.16 reads ``model.is_gradient_checkpointing``, which transformers >= 5.2x deprecates with a FutureWarning a
    # user cannot act on (rlhf-ext itself passes the new ``activation_checkpointing`` name): not on the CLI's terminal
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    if host_configured_logging():
        if (level := verbosity_from_env()) is not None:
            library_logger().setLevel(level)
    else:
        enable_console_logging()
    if not stderr_is_terminal():
        for name in HF_PROGRESS_BAR_SWITCHES:
            os.environ.setdefault(name, "1")
        if "datasets" in sys.modules:  # imported already: its switch was read at import time
            from datasets.utils.logging import disable_progress_bar

            disable_progress_bar()


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Silence ``datasets`` progress bars while saving or mapping many small datasets (re-enabled after)."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()


#: Seconds between two lines of :class:`ProgressLines` (a bar redraws continuously; a log gets a line this often).
PROGRESS_LINE_SECONDS = 30.0


class ProgressLines:
    """Progress of a long loop as log lines, for a stderr that is no terminal (a pipe or a log file, where a bar
    would be one ever-growing line): ``segmenting: 1024/100000 pairs (1.0%), 35.2 pairs/s, about 47 min left``, one
    line when it starts, at most one every :data:`PROGRESS_LINE_SECONDS`, one at the end. Counts like ``tqdm``
    (``update``, ``n``, ``set_postfix``, ``close``, a context manager), so a caller takes either (:func:`progress`)."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "it") -> None:
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self._start, self._start_n = time.monotonic(), initial
        self._last, self._logged = self._start, initial
        self.postfix: dict = {}
        logger.info("%s: %d/%d %s", desc, initial, total, unit)

    def set_postfix(self, postfix: dict | None = None, refresh: bool = True) -> None:
        """Extra counts shown at the end of the next line (``skipped 3``), as tqdm's postfix."""
        self.postfix = dict(postfix or {})

    def _line(self, now: float) -> None:
        rate = (self.n - self._start_n) / max(now - self._start, 1e-9)
        left = (self.total - self.n) / rate if rate > 0 else float("inf")
        eta = "" if self.n >= self.total or not math.isfinite(left) else f", about {_duration(left)} left"
        pct = f" ({100 * self.n / self.total:.1f}%)" if self.total else ""
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        logger.info(
            "%s: %d/%d %s%s, %.1f %s/s%s%s", self.desc, self.n, self.total, self.unit, pct, rate, self.unit, eta, extra
        )
        self._last, self._logged = now, self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= PROGRESS_LINE_SECONDS:
            self._line(now)

    def close(self) -> None:
        if self.n != self._logged:
            self._line(time.monotonic())

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400 * 3:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def progress(total: int, initial: int = 0, desc: str = "", unit: str = "it", bar: bool | None = None):
    """A tqdm bar when ``bar`` (default: stderr is a terminal), else :class:`ProgressLines`; ``bar=False`` given
    explicitly (``--no-progress``) still logs the lines: a long run is never silent."""
    if bar is None:
        bar = stderr_is_terminal()
    if bar:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, mininterval=0.5,
                    smoothing=0.05, file=sys.stderr)  # fmt: skip
    return ProgressLines(total, initial, desc, unit)
