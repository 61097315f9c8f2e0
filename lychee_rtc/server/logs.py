"""Log hygiene for hostile traffic: a malformed HTTP request is a one-line note, not a traceback.

aiohttp logs every request it cannot parse at ERROR with a full traceback, so a scanner can fill the
log at will. The filter turns those records into DEBUG lines without the traceback and lets one
WARNING a minute through, with how many there were.
"""

from __future__ import annotations

import logging
import re
import time

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_log import AccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from lychee_rtc.calls.tokens import WHIP_RESOURCE_PREFIX

SUMMARY_PERIOD_S = 60.0


class MalformedRequestFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._pending = 0
        self._summary_at = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.count += 1
        self._pending += 1
        reason = " ".join(str(exc.message).split())[:160]
        record.exc_info = None
        record.exc_text = None
        now = time.monotonic()
        if now - self._summary_at >= SUMMARY_PERIOD_S:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "%d malformed HTTP request(s) refused with 400 since the last note; latest: %s"
            record.args = (self._pending, reason)
            self._summary_at, self._pending = now, 0
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg, record.args = "malformed HTTP request refused with 400: %s", (reason,)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install_http_log_filter() -> MalformedRequestFilter:
    """Idempotent: the filter on aiohttp's server logger, installed once per process."""
    logger = logging.getLogger("aiohttp.server")
    for existing in logger.filters:
        if isinstance(existing, MalformedRequestFilter):
            return existing
    flt = MalformedRequestFilter()
    logger.addFilter(flt)
    return flt


class RedactingAccessLogger(AccessLogger):
    """The access log, with WHIP resource ids (capabilities, like passwords) masked."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if request is not None and WHIP_RESOURCE_PREFIX in request.rel_url.path:
            try:
                masked = re.sub(rf"{WHIP_RESOURCE_PREFIX}[A-Za-z0-9_-]+", WHIP_RESOURCE_PREFIX + "...",
                                request.rel_url.path)
                request = request.clone(rel_url=masked)
            except Exception:  # never lose the log line over the mask
                pass
        super().log(request, response, time)
