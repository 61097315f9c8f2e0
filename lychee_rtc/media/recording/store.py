"""Where recordings live: one folder per session (audio.ogg, events.jsonl, meta.json), and retention.

``meta.json`` says what a recording is (its state, times, size) and holds a hash of the session's
token, so the session's client can still fetch its recording after the call, when the session is
gone. A folder whose meta still says ``recording`` at start-up belongs to a server that died: its
files play up to the kill and it is marked ``interrupted``. Retention never touches a recording in
progress.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from lychee_rtc.config import RecordingSettings
from lychee_rtc.media.recording.recorder import CallRecorder
from lychee_rtc.media.recording.upload import S3Uploader
from lychee_rtc.media.recording.writer import RecordingWriter, WriterState

log = logging.getLogger(__name__)

AUDIO_FILE = "audio.ogg"
EVENTS_FILE = "events.jsonl"
META_FILE = "meta.json"
AUDIO_TYPE = "audio/ogg; codecs=opus"
EVENTS_TYPE = "application/x-ndjson"
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class RecordingBusy(Exception):
    """The recording is still being written (its session is live)."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RecordingStore:
    def __init__(self, settings: RecordingSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.directory = settings.directory
        self.clock = clock
        self.active: dict[str, CallRecorder] = {}
        # Finished recordings are copied to object storage on their writer's thread (recording.s3).
        self.uploader = S3Uploader(settings.s3) if settings.s3 is not None else None
        self._lock = threading.Lock()  # meta files and retention are touched from writer threads too

    # --- start-up ----------------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Mark recordings a dead server left open as ``interrupted``; then enforce retention."""
        if not self.directory.is_dir():
            return []  # nothing recorded yet: the folder is made by the first recording
        found = []
        for meta in self._metas():
            if meta.get("status") == "recording" and meta["session_id"] not in self.active:
                meta["status"] = "interrupted"
                self._write_meta(meta)
                found.append(meta["session_id"])
        self.enforce_retention()
        return found

    # --- a new recording ----------------------------------------------------------------------------

    def open(self, session_id: str, token: str | None, header: dict[str, Any]) -> CallRecorder:
        if not _ID.fullmatch(session_id):
            raise ValueError(f"not a session id: {session_id!r}")
        folder = self.directory / session_id
        t0 = self.clock()
        wall = time.time()
        meta = {"session_id": session_id, "status": "recording", "started_at": wall, "ended_at": None,
                "duration_s": None, "bytes": 0, "token_sha256": token_hash(token) if token else None,
                "audio": AUDIO_FILE, "events": EVENTS_FILE, "channels": ["caller", "agent"], "rate": 48000,
                **header}
        writer = RecordingWriter(folder / AUDIO_FILE, folder / EVENTS_FILE, t0, self.settings.bitrate,
                                 self.settings.queue_items, self.clock, complexity=self.settings.complexity,
                                 on_done=lambda state: self._finished(session_id, state),
                                 prepare=lambda: self._create(folder, meta))
        recorder = CallRecorder(session_id, writer, self.clock, wall)
        self.active[session_id] = recorder
        recorder.start({"session_id": session_id, "started_at": wall, "rate": 48000,
                        "channels": ["caller", "agent"], **header})
        return recorder

    def _create(self, folder: Path, meta: dict[str, Any]) -> None:
        """On the writer's thread, before anything else: a disk that hangs holds up that thread only."""
        self.directory.mkdir(parents=True, exist_ok=True)
        folder.mkdir(exist_ok=False)
        self._write_meta(meta)

    def _finished(self, session_id: str, state: WriterState) -> None:
        """On the writer's thread, once its files are closed."""
        recorder = self.active.get(session_id)
        try:
            if self.meta(session_id) is not None:  # nothing to describe when the folder was never made
                self._write_final_meta(session_id, state)
        except OSError as exc:
            log.error("recording %s: cannot write its meta file: %s", session_id, exc)
        self.active.pop(session_id, None)
        if recorder is not None and self.uploader is not None and state.status == "complete":
            self._upload(session_id)
        try:
            self.enforce_retention()
        except OSError as exc:
            log.error("recording retention failed: %s", exc)

    def _upload(self, session_id: str) -> None:
        assert self.uploader is not None
        try:
            outcome: dict[str, Any] = {"uploaded_to": self.uploader.upload(self.directory / session_id)}
        except Exception as exc:  # the network, the bucket, credentials: the local copy stays
            log.error("recording %s: upload failed: %s", session_id, exc)
            outcome = {"upload_error": f"{type(exc).__name__}: {exc}"}
        meta = self.meta(session_id)
        if meta is not None:
            meta.update(outcome)
            self._write_meta(meta)

    def _write_final_meta(self, session_id: str, state: WriterState) -> None:
        meta = self.meta(session_id) or {"session_id": session_id}
        meta.update(status=state.status, ended_at=time.time(), bytes=self._size(self.directory / session_id),
                    duration_s=round(state.counters.encoded_samples / 48000, 3),
                    items_dropped=state.counters.items_dropped, late_samples=state.counters.late_samples,
                    overflow_samples=state.counters.overflow_samples)
        meta["alignment"] = {"transit_changes": 0, **dict(state.alignment)}
        if state.error:
            meta["error"] = state.error
        self._write_meta(meta)

    # --- reading -------------------------------------------------------------------------------------

    def meta(self, session_id: str) -> dict[str, Any] | None:
        if not _ID.fullmatch(session_id):
            return None
        try:
            meta = json.loads((self.directory / session_id / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def describe(self, meta: dict[str, Any]) -> dict[str, Any]:
        """What the HTTP listing shows (never the token hash)."""
        out = {k: v for k, v in meta.items() if k != "token_sha256"}
        recorder = self.active.get(meta["session_id"])
        if recorder is not None:
            out.update(status=recorder.status()["state"], bytes=self._size(self.directory / meta["session_id"]))
        return out

    def list(self) -> list[dict[str, Any]]:
        return sorted((self.describe(m) for m in self._metas()), key=lambda m: m.get("started_at") or 0)

    def path(self, session_id: str, name: str) -> Path | None:
        if self.meta(session_id) is None:
            return None
        path = self.directory / session_id / name
        return path if path.is_file() else None

    @staticmethod
    def token_matches(meta: dict[str, Any], token: str | None) -> bool:
        want = meta.get("token_sha256")
        return bool(want and token and hmac.compare_digest(want, token_hash(token)))

    # --- deleting ------------------------------------------------------------------------------------

    def delete(self, session_id: str) -> bool:
        """Remove a finished recording; RecordingBusy while its session is still recording."""
        if session_id in self.active:
            raise RecordingBusy(session_id)
        if self.meta(session_id) is None:
            return False
        with self._lock:
            shutil.rmtree(self.directory / session_id, ignore_errors=True)
        return True

    def enforce_retention(self, now: float | None = None) -> list[str]:
        """Delete finished recordings older than ``max_age_s``, then the oldest until the total fits."""
        now = time.time() if now is None else now
        removed = []
        with self._lock:
            metas = sorted(self._metas(), key=lambda m: m.get("started_at") or 0)
            sizes = {m["session_id"]: self._size(self.directory / m["session_id"]) for m in metas}
            total = sum(sizes.values())
            for meta in metas:
                sid = meta["session_id"]
                if sid in self.active:
                    continue
                too_old = now - (meta.get("ended_at") or meta.get("started_at") or now) > self.settings.max_age_s
                if too_old or total > self.settings.max_total_bytes:
                    shutil.rmtree(self.directory / sid, ignore_errors=True)
                    total -= sizes[sid]
                    removed.append(sid)
        for sid in removed:
            log.info("recording %s removed by retention", sid)
        return removed

    def wait_idle(self, timeout: float) -> bool:
        """Wait (a thread, not the loop) for every writer to finish; False if some did not in time."""
        deadline = time.monotonic() + timeout
        for recorder in list(self.active.values()):
            recorder.writer.join(max(0.0, deadline - time.monotonic()))
        return not any(r.writer.is_alive() for r in list(self.active.values()))

    # --- internals -----------------------------------------------------------------------------------

    def _metas(self) -> list[dict[str, Any]]:
        if not self.directory.is_dir():
            return []
        out = []
        for entry in self.directory.iterdir():
            meta = self.meta(entry.name) if entry.is_dir() else None
            if meta is not None and meta.get("session_id") == entry.name:
                out.append(meta)
        return out

    def _write_meta(self, meta: dict[str, Any]) -> None:
        folder = self.directory / meta["session_id"]
        tmp = folder / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder / META_FILE)  # a reader never sees half a meta file

    @staticmethod
    def _size(folder: Path) -> int:
        try:
            return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        except OSError:
            return 0
