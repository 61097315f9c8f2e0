"""Placing calls through the Janus SIP plugin (the procedure; the attempt itself is ``dial_out``)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from typing import Any

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.calls.tokens import new_session_token
from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.gateway.dial_out import OutboundCall, sip_target, status_for_sip_code
from lychee_rtc.gateway.errors import checked_uri
from lychee_rtc.gateway.janus_api import JanusError
from lychee_rtc.gateway.line import Line
from lychee_rtc.rtc.sdp import SdpError

log = logging.getLogger(__name__)

KEEP_ENDED = 256  # finished attempts kept for GET, oldest forgotten first
# Why an attempt we ended ourselves has no final SIP status of its own to report.
GAVE_UP = {"no_answer": "no final answer within {:g} s: cancelled",
           "cancelled": "cancelled (DELETE) before it was answered"}
HANGUP_WAIT_S = 5.0  # how long a CANCEL may take before the line is given back anyway


class GatewayUnavailable(Exception):
    """The gateway cannot place a call now (not registered, no free line, Janus refused it)."""


class Dialer:
    def __init__(self, gateway: Any) -> None:  # the JanusSipGateway that owns it (which imports this)
        self.gateway = gateway
        self.calls: OrderedDict[str, OutboundCall] = OrderedDict()

    def find(self, key: str) -> OutboundCall | None:
        found = self.calls.get(key)
        if found is not None:
            return found
        return next((c for c in self.calls.values()
                     if c.session is not None and c.answered_at is not None and c.session.id == key), None)

    # --- placing a call ----------------------------------------------------------------------------

    async def dial(self, to: str, caller_id: str | None, options: SessionOptions,
                   ring_timeout_s: float) -> OutboundCall:
        """Start a call and return once Janus has sent the INVITE (or raise why it could not)."""
        checked_uri(to, "to")
        if caller_id is not None:
            checked_uri(caller_id, "from")
        gw = self.gateway
        api = gw._api
        if api is None or not gw.registered:
            raise GatewayUnavailable("the SIP gateway is not registered")
        line = next((ln for ln in gw._lines.values() if ln.free), None)
        if line is None:
            raise ServerFull(gw.registry.settings.session.retry_after_s)
        prefix = gw.registry.id_prefix  # a cluster entry routes the call's requests by it
        attempt = OutboundCall(to=to, caller_id=caller_id, ring_timeout_s=ring_timeout_s,
                               id=f"call_{prefix}{secrets.token_hex(8)}", token=new_session_token(prefix))
        loop = asyncio.get_running_loop()
        attempt.sent, attempt.outcome = loop.create_future(), loop.create_future()
        line.outbound = attempt  # the line is taken from here on
        gw._spawn(self._place(line, attempt, options))
        await attempt.sent  # raises ServerFull, GatewayUnavailable or SdpError when the attempt failed early
        self.calls[attempt.id] = attempt
        while len(self.calls) > KEEP_ENDED and next(iter(self.calls.values())).final:
            self.calls.popitem(last=False)
        return attempt

    async def _place(self, line: Line, attempt: OutboundCall, options: SessionOptions) -> None:
        gw = self.gateway
        call = None
        try:
            async with gw.registry.admission(options) as slot:
                origin = {"kind": "sip", "gateway": "janus", "direction": "outbound", "call_id": attempt.id,
                          "caller": attempt.caller_id or gw.settings.sip_uri, "callee": attempt.to,
                          "sip_call_id": attempt.sip_call_id}
                call = await gw.rtc.prepare_offer(slot, options, origin, token=attempt.token)
                attempt.session = call.session
                await self._invite(line, attempt, call)
                answered = await self._outcome(line, attempt)
                if answered is not None:
                    await self._connect(line, attempt, call, answered)
                    return
                await gw.rtc.discard_offer(call)
                await call.session.close(attempt.status)  # never started: this frees the slot
                attempt.close_listeners()
        except BaseException as exc:
            if attempt.sent is not None and not attempt.sent.done():
                refusal = GatewayUnavailable(f"Janus refused the call: {exc}") if isinstance(exc, JanusError) else exc
                attempt.sent.set_exception(refusal if isinstance(refusal, Exception) else GatewayUnavailable("stopped"))
            if not attempt.final:
                attempt.set_status("failed", reason=str(exc) or type(exc).__name__)
            if call is not None and line.session_id != call.session.id:
                await gw.rtc.discard_offer(call)
                if not call.session.closed:
                    await call.session.close("failed")
            attempt.close_listeners()
            if not isinstance(exc, Exception):
                raise
            if not isinstance(exc, (ServerFull, GatewayUnavailable, SdpError)):
                log.warning("SIP gateway: call %s to %s failed: %r", attempt.id, attempt.to, exc)
        finally:
            if line.session_id is None and line.outbound is attempt:
                if call is not None:
                    await self._reset_webrtc(line)
                line.outbound = None

    async def _reset_webrtc(self, line: Line) -> None:
        """Drop the WebRTC leg Janus began for an unanswered call: the handle takes a new offer next time
        (without this Janus refuses the next call on the line: "Error setting ICE locally")."""
        api = self.gateway._api
        if api is None:
            return
        try:
            await api.request({"janus": "hangup"}, line.handle_id)
        except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
            log.debug("SIP gateway: resetting line %d: %s", line.handle_id, exc)

    async def _invite(self, line: Line, attempt: OutboundCall, call: Any) -> None:
        gw = self.gateway
        api = gw._api
        if api is None:
            raise GatewayUnavailable("the connection to Janus was lost")
        body: dict[str, Any] = {"request": "call", "uri": sip_target(attempt.to, gw.settings.registrar),
                                "call_id": attempt.sip_call_id}
        if attempt.caller_id:
            # The From is the registered identity; a trunk takes the caller id from this header.
            body["headers"] = {"P-Asserted-Identity": f"<{attempt.caller_id}>"}
        gw.counters.dialled += 1
        attempt.set_status("dialing")
        await api.message(line.handle_id, body, {"type": "offer", "sdp": call.answer_sdp})
        assert attempt.sent is not None
        await asyncio.wait_for(asyncio.shield(attempt.sent), gw.settings.request_timeout_s)
        assert attempt.outcome is not None
        if attempt.outcome.done() and attempt.outcome.result()[0] == "error":
            _, code, text = attempt.outcome.result()
            raise GatewayUnavailable(f"Janus refused the call: {text} ({code})")

    async def _outcome(self, line: Line, attempt: OutboundCall) -> dict | None:
        """Wait for the far end; the answer's JSEP when answered, else None (status set)."""
        assert attempt.outcome is not None
        try:
            result = await asyncio.wait_for(asyncio.shield(attempt.outcome), attempt.ring_timeout_s)
        except asyncio.TimeoutError:
            await self.give_up(attempt, "no_answer")
            line_of = next((ln for ln in self.gateway._lines.values() if ln.outbound is attempt), None)
            if line_of is not None:
                await self._cancel(line_of, attempt)  # also when a cancel waited for a 1xx that never came
            try:
                result = await asyncio.wait_for(asyncio.shield(attempt.outcome), HANGUP_WAIT_S)
            except asyncio.TimeoutError:
                result = ("hangup", 0, "no final answer to our CANCEL")
        kind = result[0]
        if kind == "accepted":
            jsep = result[1] or attempt.early_answer
            if attempt.give_up is None and jsep and isinstance(jsep.get("sdp"), str):
                return jsep
            await self._hang_up(line)  # answered as we gave up (or without an answer we can use)
            attempt.set_status(attempt.give_up or "failed", reason=None if attempt.give_up else "answer without SDP")
            return None
        if kind == "error":
            attempt.set_status("failed", reason=str(result[2]))
            return None
        code, reason = int(result[1] or 0), str(result[2] or "")
        if not code and attempt.give_up is not None:  # our CANCEL: Janus reports no final status for it
            reason = GAVE_UP[attempt.give_up].format(attempt.ring_timeout_s)
        attempt.set_status(status_for_sip_code(code, attempt.give_up), code or None, reason or None)
        return None

    async def _connect(self, line: Line, attempt: OutboundCall, call: Any, jsep: dict) -> None:
        gw = self.gateway
        try:
            await gw.rtc.complete_offer(call, jsep["sdp"])
        except SdpError as exc:
            await self._hang_up(line)
            attempt.set_status("failed", reason=str(exc))
            await gw.rtc.discard_offer(call)
            await call.session.close("failed")
            attempt.close_listeners()
            return
        session_id = call.session.id
        line.session_id = session_id
        gw.allow_transfer(call.session)
        gw.counters.dial_answered += 1
        attempt.set_status("answered", 200)
        call.session.on_closing.append(attempt.end)  # "completed" goes out before session.closed
        call.on_closed.append(lambda reason: self._ended(line, attempt, reason))
        call.on_closed.append(lambda reason, line=line, sid=session_id: gw._session_ended(line, sid, reason))
        log.info("SIP gateway: call %s to %s answered; session %s", attempt.id, attempt.to, session_id)
        if line.caller_hung_up:  # the far end hung up while the answer was being applied
            await gw.registry.close(session_id, "caller_hangup")

    def _ended(self, line: Line, attempt: OutboundCall, reason: str) -> None:
        attempt.end(reason)  # already done as the session closed; this covers any other way
        attempt.close_listeners()
        if line.outbound is attempt:
            line.outbound = None

    # --- giving up -----------------------------------------------------------------------------------

    async def give_up(self, attempt: OutboundCall, why: str) -> bool:
        """Cancel an attempt that is not answered yet (``why``: no_answer or cancelled)."""
        if attempt.final or attempt.answered_at is not None:
            return False
        attempt.give_up = attempt.give_up or why
        line = next((ln for ln in self.gateway._lines.values() if ln.outbound is attempt), None)
        if line is None:
            attempt.far_end("hangup", 0, why)
            return True
        if attempt.ringing_at is None and why == "cancelled":
            # A CANCEL may not go before the far end's first provisional answer (RFC 3261 9.1),
            # and Janus drops a hang-up sent earlier: it is sent on the first 180/183 instead.
            return True
        await self._cancel(line, attempt)
        return True

    async def _cancel(self, line: Line, attempt: OutboundCall) -> None:
        if not attempt.cancel_sent:
            attempt.cancel_sent = True
            await self._hang_up(line)  # Janus sends CANCEL for a call not answered yet

    async def _hang_up(self, line: Line) -> None:
        api = self.gateway._api
        if api is None:
            return
        try:
            await api.message(line.handle_id, {"request": "hangup"})
        except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
            log.warning("SIP gateway: hanging up line %d: %s", line.handle_id, exc)

    def _ringing(self, line: Line, attempt: OutboundCall, code: int) -> None:
        attempt.set_status("ringing", code)
        if attempt.give_up is not None and not attempt.cancel_sent:  # cancelled before this 1xx
            self.gateway._spawn(self._cancel(line, attempt))

    # --- Janus's events for a line that is dialling ----------------------------------------------------

    def on_event(self, line: Line, message: dict[str, Any]) -> bool:
        """Handle an event of a line whose call is not answered yet; False: not about the attempt."""
        attempt = line.outbound
        assert attempt is not None
        if attempt.outcome is not None and attempt.outcome.done():
            if message.get("janus") == "event" and \
                    (message.get("plugindata", {}).get("data", {}).get("result") or {}).get("event") == "hangup":
                line.caller_hung_up = True  # hung up while the answer was being applied
            return True
        if message.get("janus") == "hangup":  # the WebRTC leg to Janus went down first
            attempt.far_end("hangup", 0, f"gateway {message.get('reason', 'hangup')}")
            return True
        if message.get("janus") != "event":
            return False
        data = message.get("plugindata", {}).get("data", {})
        if "error_code" in data:
            attempt.far_end("error", int(data["error_code"]), str(data.get("error", "")))
            return True
        result = data.get("result") or {}
        event = result.get("event")
        if event == "calling":
            if attempt.sent is not None and not attempt.sent.done():
                attempt.sent.set_result(None)
        elif event == "ringing" or (event == "proceeding" and int(result.get("code", 0) or 0) in (180, 183)):
            self._ringing(line, attempt, int(result.get("code", 180) or 180))
        elif event == "progress":  # 183 with early media: its SDP is the call's answer
            attempt.early_answer = message.get("jsep")
            self._ringing(line, attempt, 183)
        elif event == "accepted":
            attempt.far_end("accepted", message.get("jsep"))
        elif event == "hangup":
            attempt.far_end("hangup", result.get("code", 0), result.get("reason", ""))
        elif event == "hangingup" and attempt.give_up is not None:
            # Janus reports no hangup event for a call it cancelled itself: this is the end of it.
            attempt.far_end("hangup", 0, attempt.give_up)
        else:
            return False
        return True
