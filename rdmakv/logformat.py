"""Log output of the ``rdmakv`` commands: plain text, or one JSON object per record.

``--log-format json`` (config ``log.format``, ``RDMAKV_LOG_FORMAT``) is for log
collectors: every record is exactly one line holding one JSON object with
``ts`` (ISO-8601, UTC, milliseconds), ``level``, ``logger`` and ``msg``, plus
``exc_info`` / ``stack_info`` text when the record carries them. Newlines inside
a message or a traceback are escaped by the JSON encoding, so a line is never
split. Only the stdlib :mod:`logging` is used: any library logging through it
comes out in the same format.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        # default=str: a message argument that JSON cannot hold never loses the record.
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: int, fmt: str, stream: TextIO | None = None) -> None:
    """Route the root logger (and :mod:`warnings`) to ``stream`` (stderr) in ``fmt``.

    Replaces any handlers already on the root logger, so calling it again
    (e.g. once the config file named the format) switches cleanly.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # warnings.warn (e.g. MemoryLockWarning) goes through logging: one record,
    # in the same format, instead of a two-line message of its own.
    logging.captureWarnings(True)


__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging"]
