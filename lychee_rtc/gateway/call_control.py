"""OpenAI-style SIP call control: an incoming call announced by webhook, then accepted or rejected.

With ``gateway.janus.webhook_url`` set, an incoming call is not answered at once. It keeps ringing
while a ``realtime.call.incoming`` event is POSTed to the application, signed the Standard
Webhooks way (OpenAI's: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature: v1,<base64
HMAC-SHA256 of "id.timestamp.body">`` keyed by the base64 part of a ``whsec_`` secret), so the
``openai`` package's ``client.webhooks.unwrap`` accepts it. The application answers with
``accept`` (session options) or ``reject`` (a SIP status); the call id it is given is the id the
session will have, so hangup, refer and the sideband use it as for any call. A call nobody decides
on within ``decision_timeout_s``, or whose webhook cannot be delivered, is declined with 480.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from lychee_rtc.engine.base import SessionOptions

log = logging.getLogger(__name__)

UNAVAILABLE = 480  # Temporarily Unavailable: no decision, or the application could not be told
DEFAULT_REJECT = 603  # Decline, as OpenAI's reject without a status code
KEEP_DECIDED = 256


def webhook_signature(secret: str, webhook_id: str, timestamp: int, body: str) -> str:
    """The ``webhook-signature`` header value for ``body`` (Standard Webhooks, version 1)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{webhook_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def incoming_event(call_id: str, sip_headers: list[dict[str, str]]) -> dict[str, Any]:
    return {"id": f"evt_{secrets.token_hex(12)}", "object": "event", "created_at": int(time.time()),
            "type": "realtime.call.incoming", "data": {"call_id": call_id, "sip_headers": sip_headers}}


class DecisionRefused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class PendingCall:
    call_id: str  # also the id of the session it becomes
    decision: asyncio.Future  # ("accept", SessionOptions) | ("reject", code) | ("gone",)
    answered: asyncio.Future = field(default_factory=lambda: _quiet_future())


def _quiet_future() -> asyncio.Future:
    """A future whose error may have nobody waiting (no accept was sent): not logged as lost."""
    future = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


class CallControl:
    def __init__(self, url: str, secret: str, webhook_timeout_s: float, decision_timeout_s: float) -> None:
        self.url = url
        self.secret = secret
        self.webhook_timeout_s = webhook_timeout_s
        self.decision_timeout_s = decision_timeout_s
        self.pending: dict[str, PendingCall] = {}
        self.decided: OrderedDict[str, None] = OrderedDict()  # recent ids, to tell "already decided" from unknown
        self.delivered = 0
        self.undelivered = 0

    async def ask(self, call_id: str, sip_headers: list[dict[str, str]]) -> tuple:
        """Announce the call and wait for the application's decision (or a reason to decline)."""
        pending = PendingCall(call_id, asyncio.get_running_loop().create_future())
        self.pending[call_id] = pending
        delivery = asyncio.create_task(self._deliver(incoming_event(call_id, sip_headers)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.decision_timeout_s
        try:
            # The application may decide while its webhook handler still runs: both are awaited together.
            done, _ = await asyncio.wait({pending.decision, delivery}, timeout=self.decision_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if pending.decision.done():
                return pending.decision.result()
            if delivery in done and not delivery.result():
                return ("reject", UNAVAILABLE, "the webhook could not be delivered")
            try:
                return await asyncio.wait_for(asyncio.shield(pending.decision), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return ("reject", UNAVAILABLE, "no decision in time")
        finally:
            if not delivery.done():
                delivery.cancel()
            if not pending.decision.done():  # too late for the application to decide now
                pending.decision.set_result(("timeout",))

    def finish(self, call_id: str, error: DecisionRefused | None = None) -> None:
        """The decision was carried out (or could not be): the accept or reject request returns."""
        pending = self.pending.pop(call_id, None)
        if pending is None or pending.answered.done():
            return
        self.decided[call_id] = None
        while len(self.decided) > KEEP_DECIDED:
            self.decided.popitem(last=False)
        if error is None:
            pending.answered.set_result(None)
        else:
            pending.answered.set_exception(error)

    def caller_gone(self, call_id: str) -> None:
        pending = self.pending.get(call_id)
        if pending is not None and not pending.decision.done():
            pending.decision.set_result(("gone",))

    async def accept(self, call_id: str, options: SessionOptions) -> None:
        """Answer a ringing call; returns once its session exists (its id is ``call_id``)."""
        pending = self._undecided(call_id)
        pending.decision.set_result(("accept", options))
        await asyncio.shield(pending.answered)

    async def reject(self, call_id: str, status_code: int) -> None:
        pending = self._undecided(call_id)
        pending.decision.set_result(("reject", status_code, "rejected"))
        await asyncio.shield(pending.answered)

    def _undecided(self, call_id: str) -> PendingCall:
        pending = self.pending.get(call_id)
        if pending is None and call_id in self.decided:
            raise DecisionRefused(409, "call_already_decided", f"call {call_id!r} was already accepted or rejected")
        if pending is None:
            raise DecisionRefused(404, "call_not_found", f"no incoming call {call_id!r} waiting for a decision")
        if pending.decision.done():
            raise DecisionRefused(409, "call_already_decided", f"call {call_id!r} was already accepted or rejected")
        return pending

    async def _deliver(self, event: dict[str, Any]) -> bool:
        body = json.dumps(event, separators=(",", ":"))
        timestamp = int(time.time())
        headers = {"Content-Type": "application/json", "webhook-id": event["id"],
                   "webhook-timestamp": str(timestamp),
                   "webhook-signature": webhook_signature(self.secret, event["id"], timestamp, body)}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.webhook_timeout_s)) as http:
                async with http.post(self.url, data=body.encode(), headers=headers) as resp:
                    ok = 200 <= resp.status < 300
                    if not ok:
                        log.warning("SIP gateway: webhook %s answered %d", self.url, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("SIP gateway: webhook %s failed: %r", self.url, exc)
            ok = False
        if ok:
            self.delivered += 1
        else:
            self.undelivered += 1
        return ok
