"""Phone calls through a Janus media gateway: the server as a SIP user agent behind Janus's SIP plugin.

The connector is a client of the server, not a server of its own: it registers the configured SIP
identity through Janus, and each incoming call becomes a normal session, created through the same
call registry (and capacity) as an HTTP offer, with Janus's WebRTC offer. Janus relays the
caller's G.711 RTP to that session's WebRTC leg without transcoding.

Janus's SIP plugin takes one call per plugin handle, so the connector keeps a master handle (the
registration) and helper handles, one "line" each. A call that finds no free session is refused
with 486 Busy Here, never answered into silence. When Janus goes away, every call it carried ends
and the connector reconnects, re-attaches and registers again; while connected it refreshes the
registration at half its lifetime.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from lychee_rtc.config import JanusGatewaySettings
from lychee_rtc.engine.base import DTMF_DIGITS, SessionOptions
from lychee_rtc.calls.call import ServerFull
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.gateway.call_control import CallControl, DecisionRefused
from lychee_rtc.gateway.consult import Consults
from lychee_rtc.gateway.dialer import Dialer
from lychee_rtc.gateway.janus_api import JanusApi, JanusError
from lychee_rtc.gateway.line import Line
from lychee_rtc.gateway.errors import CallActionRefused
from lychee_rtc.gateway.transfer import Transfers
from lychee_rtc.rtc.negotiator import RtcNegotiator
from lychee_rtc.rtc.sdp import SdpError
from lychee_rtc.session.protocol import ProtocolError

log = logging.getLogger(__name__)

PLUGIN = "janus.plugin.sip"
BUSY = 486
NOT_ACCEPTABLE = 488
RECONNECT_MIN_S = 0.2


def dtmf_from_info(content_type: str, content: str) -> str | None:
    """The key in a SIP INFO body (``application/dtmf-relay`` ``Signal=5`` or ``application/dtmf`` ``5``)."""
    kind = content_type.split(";")[0].strip().lower()
    value: str | None = None
    if kind == "application/dtmf-relay":
        for line in content.splitlines():
            name, _, rest = line.partition("=")
            if name.strip().lower() == "signal":
                value = rest.strip()
                break
    elif kind == "application/dtmf":
        value = content.strip()
    if value is None:
        return None
    if value.isdigit() and 10 <= int(value) <= 15:  # some phones send the RFC 4733 number
        value = DTMF_DIGITS[int(value)]
    value = value.upper()
    return value if len(value) == 1 and value in DTMF_DIGITS else None


def sip_headers(origin: dict[str, Any], result: dict[str, Any]) -> list[dict[str, str]]:
    """The INVITE's identifying headers, as OpenAI's webhook lists them (no authorization headers)."""
    caller = f"<{origin['caller']}>"
    if origin.get("caller_name"):
        caller = f'"{origin["caller_name"]}" {caller}'
    headers = [{"name": "From", "value": caller}, {"name": "To", "value": f"<{origin['callee']}>"},
               {"name": "Call-ID", "value": origin["sip_call_id"]}]
    for name, value in (result.get("headers") or {}).items():  # Janus's incoming_header_prefixes, if set
        headers.append({"name": str(name), "value": str(value)})
    return headers


@dataclass
class GatewayCounters:
    connects: int = 0
    registrations: int = 0
    registration_failures: int = 0
    calls: int = 0
    answered: int = 0
    busy: int = 0
    rejected: int = 0
    missed: int = 0
    caller_hangups: int = 0
    server_hangups: int = 0
    dtmf_info: int = 0
    dialled: int = 0
    dial_answered: int = 0


@dataclass
class JanusSipGateway:
    settings: JanusGatewaySettings
    registry: CallRegistry
    rtc: RtcNegotiator
    counters: GatewayCounters = field(default_factory=GatewayCounters)
    registered: bool = False
    _api: JanusApi | None = None
    _lines: dict[int, Line] = field(default_factory=dict)
    _task: asyncio.Task | None = None
    _call_tasks: set[asyncio.Task] = field(default_factory=set)
    _stopping: bool = False
    dialer: Dialer = field(init=False)
    transfers: Transfers = field(init=False)
    consults: Consults = field(init=False)
    control: CallControl | None = field(init=False)
    hold_audio: Any = None  # the music on hold at the engine's output rate, loaded at the first hold

    def __post_init__(self) -> None:
        self.dialer = Dialer(self)
        self.transfers = Transfers(self)
        self.consults = Consults(self)
        s = self.settings
        self.control = None if s.webhook_url is None else CallControl(
            s.webhook_url, s.webhook_secret or "", s.webhook_timeout_s, s.decision_timeout_s)

    # --- lifetime ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="janus-sip-gateway")

    async def stop(self) -> None:
        self._stopping = True
        for attempt in list(self.dialer.calls.values()):
            await self.dialer.give_up(attempt, "cancelled")
        for line in list(self._lines.values()):
            if line.session_id is not None:
                await self.registry.close(line.session_id, "server_shutdown")  # hangs the call up
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for task in list(self._call_tasks):
            task.cancel()

    @property
    def lines(self) -> int:
        return self.settings.lines or self.registry.capacity + 1

    def carries(self, session_id: str) -> bool:
        """Whether this session is one of the gateway's phone calls."""
        return any(line.session_id == session_id for line in self._lines.values())

    def status(self) -> dict[str, Any]:
        busy = sum(1 for line in self._lines.values() if not line.free)
        return {"registered": self.registered, "lines": len(self._lines), "busy_lines": busy,
                "counters": vars(self.counters).copy()}

    async def _run(self) -> None:
        delay = RECONNECT_MIN_S
        while not self._stopping:
            api = JanusApi(self.settings.url, self.settings.api_secret, self.settings.request_timeout_s,
                           self._on_event)
            try:
                await api.open()
                self._api = api
                self.counters.connects += 1
                await self._set_up_lines(api)
                delay = RECONNECT_MIN_S
                await self._serve(api)
            except asyncio.CancelledError:
                await self._lost(api, "server_shutdown")
                raise
            except (OSError, ConnectionError, asyncio.TimeoutError, JanusError, KeyError, ValueError) as exc:
                log.warning("SIP gateway: Janus at %s: %s", self.settings.url, exc or type(exc).__name__)
            await self._lost(api, "gateway_lost")
            if self._stopping:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.settings.reconnect_max_s)

    async def _lost(self, api: JanusApi, reason: str) -> None:
        """Janus is gone (or we are leaving): its calls are gone with it."""
        self.registered = False
        self._api = None
        lines, self._lines = self._lines, {}
        for line in lines.values():
            if line.outbound is not None and line.session_id is None:
                line.outbound.far_end("hangup", 0, reason)
            if line.session_id is not None:
                line.caller_hung_up = True  # nobody left to send a hangup to
                await self.registry.close(line.session_id, reason)
        await api.close()

    async def _set_up_lines(self, api: JanusApi) -> None:
        master = Line(await api.attach(PLUGIN), helper=False)
        self._lines[master.handle_id] = master
        result = await self._register(api, master, {})
        master_id = result.get("master_id")
        if master_id is None:
            raise ValueError("Janus's registered event carried no master_id")
        for _ in range(self.lines - 1):
            helper = Line(await api.attach(PLUGIN), helper=True)
            self._lines[helper.handle_id] = helper
            await self._register(api, helper, {"type": "helper", "master_id": master_id})
        self.registered = True
        log.info("SIP gateway: %s registered at %s through Janus, %d lines", self.settings.sip_uri,
                 self.settings.registrar, len(self._lines))

    async def _register(self, api: JanusApi, line: Line, extra: dict[str, Any], refresh: bool = False) -> dict:
        s = self.settings
        body: dict[str, Any] = {"request": "register", "username": s.sip_uri, **extra}
        if not line.helper:
            body.update(secret=s.secret, proxy=s.registrar, register_ttl=s.register_ttl_s)
            if s.display_name:
                body["display_name"] = s.display_name
            if refresh:
                body["refresh"] = True
        line.registered = asyncio.get_running_loop().create_future()
        await api.message(line.handle_id, body)
        try:
            result = await asyncio.wait_for(line.registered, s.request_timeout_s)
        finally:
            line.registered = None
        self.counters.registrations += 1
        return result

    async def _serve(self, api: JanusApi) -> None:
        """Refresh the registration at half its lifetime until the connection to Janus ends."""
        master = next(line for line in self._lines.values() if not line.helper)
        closed = asyncio.create_task(api.closed.wait())
        try:
            while True:
                done, _ = await asyncio.wait({closed}, timeout=self.settings.register_ttl_s / 2)
                if done:
                    return
                try:
                    await self._register(api, master, {}, refresh=True)
                    self.registered = True
                except (JanusError, asyncio.TimeoutError) as exc:
                    self.registered = False
                    log.warning("SIP gateway: re-registration failed: %s", exc)
        finally:
            closed.cancel()

    # --- Janus events ------------------------------------------------------------------------------

    def _on_event(self, message: dict[str, Any]) -> None:
        log.debug("Janus event: %.300s", message)
        line = self._lines.get(message.get("sender", -1))
        if line is None:
            return
        kind = message.get("janus")
        if line.outbound is not None and line.session_id is None and self.dialer.on_event(line, message):
            return
        if kind == "hangup":  # the WebRTC leg went down (ICE/DTLS failure, or after a SIP hangup)
            self._caller_gone(line, f"gateway_{message.get('reason', 'hangup')}".replace(" ", "_").lower()[:40])
            return
        if kind != "event":
            return
        data = message.get("plugindata", {}).get("data", {})
        result = data.get("result") or {}
        event = result.get("event")
        if "error_code" in data:
            error = JanusError(int(data["error_code"]), str(data.get("error", "")))
            if self.transfers.on_event(line, result, error=str(error)):
                return
            if line.registered is not None and not line.registered.done():
                line.registered.set_exception(error)
            else:
                log.warning("SIP gateway: Janus line %d: %s", line.handle_id, error)
            return
        if self.transfers.on_event(line, result):
            return
        if event == "registered":
            if line.registered is not None and not line.registered.done():
                line.registered.set_result(result)
        elif event == "registration_failed":
            self.counters.registration_failures += 1
            self.registered = False
            error = JanusError(int(result.get("code", 0)), str(result.get("reason", "registration failed")))
            if line.registered is not None and not line.registered.done():
                line.registered.set_exception(error)
            else:
                log.warning("SIP gateway: %s", error)
        elif event == "incomingcall":
            self._spawn(self._answer(line, data, result, message.get("jsep")))
        elif event == "missed_call":
            self.counters.missed += 1
            log.warning("SIP gateway: call from %s missed: every line was busy", result.get("caller"))
        elif event == "hangup":
            self._caller_gone(line, "caller_hangup")
        elif event == "info":
            digit = dtmf_from_info(str(result.get("type", "")), str(result.get("content", "")))
            call = self.registry.calls.get(line.session_id or "")
            if digit is not None and call is not None:
                self.counters.dtmf_info += 1
                call.session.push_dtmf(digit, "sip_info")

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._call_tasks.add(task)
        task.add_done_callback(self._call_tasks.discard)

    def _caller_gone(self, line: Line, reason: str) -> None:
        if line.session_id is None:
            if line.answering:
                line.caller_hung_up = True  # the answer in progress sees it and gives up
                if self.control is not None and line.pending_call is not None:
                    self.control.caller_gone(line.pending_call)
            return
        if line.caller_hung_up:  # Janus reports the SIP hangup and then the WebRTC leg going down
            return
        call = self.registry.calls.get(line.session_id)
        if call is None or call.session.closed:
            return  # the server is ending this session (its leg going down is ours): it hangs up itself
        line.caller_hung_up = True
        self.counters.caller_hangups += 1
        self._spawn(self.registry.close(line.session_id, reason))

    # --- transfers ----------------------------------------------------------------------------------

    def allow_transfer(self, session) -> None:
        """Let the session's clients (its event stream) ask for a blind transfer, and apply the
        configured key rules (``transfer_keys``: a key the caller presses transfers the call)."""
        def handler(target_uri: str) -> None:
            self._spawn(self._transfer_for_client(session, target_uri))
        session.transfer_handler = handler
        rules = {k.upper(): v for k, v in self.settings.transfer_keys.items()}
        if rules:
            def on_key(event: dict[str, Any]) -> None:
                if event.get("type") == "input_audio_buffer.dtmf_event_received" and \
                        str(event.get("event", "")).upper() in rules:
                    handler(rules[str(event["event"]).upper()])
            session.events.add_listener(on_key)

    async def _transfer_for_client(self, session, target_uri: str) -> None:
        try:
            await self.transfers.start(session.id, target_uri)
        except CallActionRefused as exc:
            session.report_error(ProtocolError(exc.code, exc.message))

    # --- calls -------------------------------------------------------------------------------------

    async def _answer(self, line: Line, data: dict, result: dict, jsep: dict | None) -> None:
        api = self._api
        if api is None:
            return
        self.counters.calls += 1
        line.answering, line.caller_hung_up = True, False
        line.sip_call_id = data.get("call_id") or result.get("call_id")
        origin = {
            "kind": "sip",
            "gateway": "janus",
            "caller": str(result.get("username", "")),
            "caller_name": result.get("displayname"),
            "callee": str(result.get("callee", "")),
            "sip_call_id": str(line.sip_call_id or ""),
        }
        session_id: str | None = None
        try:
            if not jsep or jsep.get("type") != "offer" or not isinstance(jsep.get("sdp"), str):
                # An offerless INVITE would need us to make the offer: not supported.
                self.counters.rejected += 1
                await self._decline(api, line, NOT_ACCEPTABLE)
                return
            options = SessionOptions()
            if self.control is not None:
                if self.registry.free <= 0:  # nothing to announce: it could not be accepted
                    self.counters.busy += 1
                    await self._decline(api, line, BUSY)
                    return
                session_id = line.pending_call = self.registry.new_session_id()
                decision = await self.control.ask(session_id, sip_headers(origin, result))
                line.pending_call = None
                if decision[0] != "accept":
                    if decision[0] != "gone":  # a caller who hung up was answered 487 by Janus already
                        self.counters.rejected += 1
                        log.info("SIP gateway: call %s declined %d: %s", line.sip_call_id, decision[1], decision[2])
                        await self._decline(api, line, decision[1])
                    self.control.finish(session_id, None if decision[0] == "reject" else
                                        DecisionRefused(409, "call_ended", "the caller hung up"))
                    return
                options = decision[1]
            try:
                call = await self.rtc.create(jsep["sdp"], options, origin=origin, session_id=session_id)
            except ServerFull:
                self.counters.busy += 1
                log.info("SIP gateway: call %s from %s refused: no free session", line.sip_call_id, origin["caller"])
                await self._decline(api, line, BUSY)
                self._decided(session_id, DecisionRefused(503, "server_full", "all sessions are in use"))
                return
            except SdpError as exc:
                self.counters.rejected += 1
                log.warning("SIP gateway: call %s refused: %s", line.sip_call_id, exc)
                await self._decline(api, line, NOT_ACCEPTABLE)
                self._decided(session_id, DecisionRefused(422, "unprocessable_sdp", str(exc)))
                return
            line.session_id = call.session.id
            self.allow_transfer(call.session)
            call.on_closed.append(lambda reason, line=line, sid=call.session.id: self._session_ended(line, sid, reason))
            if line.caller_hung_up:  # the caller gave up while the session was being created
                await self.registry.close(call.session.id, "caller_hangup")
                self._decided(session_id, DecisionRefused(409, "call_ended", "the caller hung up"))
                return
            await api.message(line.handle_id, {"request": "accept"},
                              {"type": "answer", "sdp": call.answer_sdp, "trickle": False})
            self._decided(session_id)
            self.counters.answered += 1
            log.info("SIP gateway: call %s from %s answered by session %s", line.sip_call_id, origin["caller"],
                     call.session.id)
        except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
            log.warning("SIP gateway: call %s: %s", line.sip_call_id, exc)
            if line.session_id is not None:
                line.caller_hung_up = True
                await self.registry.close(line.session_id, "gateway_error")
        finally:
            line.answering, line.pending_call = False, None
            if self.control is not None and session_id is not None:
                self._decided(session_id, DecisionRefused(502, "gateway_error", "the call could not be answered"))

    def _decided(self, session_id: str | None, error: DecisionRefused | None = None) -> None:
        if self.control is not None and session_id is not None:
            self.control.finish(session_id, error)  # no-op once finished

    async def _decline(self, api: JanusApi, line: Line, code: int) -> None:
        await api.message(line.handle_id, {"request": "decline", "code": code})

    async def _session_ended(self, line: Line, session_id: str, reason: str) -> None:
        """The session is over (caller hung up, timeout, DELETE, shutdown): end the call too."""
        if line.session_id != session_id:
            return
        line.session_id, line.transfer = None, None
        api = self._api
        if line.caller_hung_up or api is None or self._lines.get(line.handle_id) is not line:
            return
        self.counters.server_hangups += 1
        try:
            await api.message(line.handle_id, {"request": "hangup"})
        except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
            log.warning("SIP gateway: hanging up call %s: %s", line.sip_call_id, exc)
