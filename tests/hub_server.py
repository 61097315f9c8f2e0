"""A Hugging Face Hub-compatible server for the download tests (aiohttp, loopback).

It answers the calls ``huggingface_hub.snapshot_download`` makes, with the Hub's headers:

* ``GET /api/models/{repo}[/revision/{rev}]``: the repository's ``sha`` and ``siblings``;
* ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``recursive``) and ``POST .../paths-info/{rev}``:
  files with size, git blob id and, for large files, their LFS ``oid`` (sha256) and size;
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``: a small file answers itself (``ETag`` = git blob id,
  ``X-Repo-Commit``, ``Content-Length``); a large ("LFS") file redirects to a signed URL on another
  host (127.0.0.2, as the Hub sends LFS files to its CDN) with ``X-Linked-Etag`` (sha256),
  ``X-Linked-Size`` and ``X-Repo-Commit``; the CDN honours ``Range: bytes=N-`` with 206;
* errors as the Hub spells them: 401 with ``X-Error-Code: GatedRepo`` for a gated repository
  without the token, 404 with ``RepoNotFound`` / ``RevisionNotFound`` / ``EntryNotFound``.

Faults the tests ask for: ``cut[path] = N`` sends the first N bytes of the file's next full GET
and then drops the connection (once); ``stall`` holds a file's GET after its first bytes until
the client goes away; ``missing`` files are listed but answer 404. Every request is logged
(method, path, Range, whether a token came) so a test can see what was fetched again.

``running(hub)`` serves it from a thread of its own, so a test can drive the real command line in
subprocesses while the server answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from aiohttp import web

LFS_SUFFIXES = (".safetensors", ".pt", ".onnx", ".bin", ".wav")
CDN_HOST = "127.0.0.2"


@dataclass(frozen=True)
class HubFile:
    path: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:  # git's blob hash
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class Repo:
    repo_id: str
    files: dict[str, HubFile]
    gated: bool = False

    @property
    def sha(self) -> str:
        h = hashlib.sha1(self.repo_id.encode())
        for path in sorted(self.files):
            h.update(path.encode() + self.files[path].blob_id.encode())
        return h.hexdigest()


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    token: bool


@dataclass
class FakeHub:
    token: str = "hf_test_token"
    repos: dict[str, Repo] = field(default_factory=dict)
    cut: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before the drop (once)
    stall: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before holding forever
    missing: set[str] = field(default_factory=set)
    log: list[Logged] = field(default_factory=list)
    stalled: threading.Event = field(default_factory=threading.Event)  # a stalled GET is holding
    _runner: web.AppRunner | None = None
    port: int = 0
    secret: bytes = b"cdn-secret"

    # -- content ---------------------------------------------------------------------------------

    def add_folder(self, repo_id: str, folder: Path, prefix: str, gated: bool = False) -> Repo:
        """Every file under ``folder`` as ``prefix/<relative path>`` of ``repo_id`` (created if new)."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id, {}, gated))
        repo.gated = repo.gated or gated
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                name = f"{prefix}/{p.relative_to(folder).as_posix()}" if prefix else p.relative_to(folder).as_posix()
                repo.files[name] = HubFile(name, p.read_bytes())
        return repo

    def add_file(self, repo_id: str, path: str, data: bytes) -> None:
        self.repos.setdefault(repo_id, Repo(repo_id, {})).files[path] = HubFile(path, data)

    def fetched(self, suffix: str = "") -> list[Logged]:
        """The full-content GETs (of the CDN or of small files) whose path ends with ``suffix``."""
        return [e for e in self.log if e.method == "GET" and ("/resolve/" in e.path or e.path.startswith("/cdn/"))
                and e.path.endswith(suffix)]

    # -- server ----------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{name}", self.info)
        app.router.add_get("/api/models/{owner}/{name}/revision/{rev}", self.info)
        app.router.add_get("/api/models/{owner}/{name}/tree/{rev}", self.tree)
        app.router.add_get("/api/models/{owner}/{name}/tree/{rev}/{path:.*}", self.tree)
        app.router.add_post("/api/models/{owner}/{name}/paths-info/{rev}", self.paths_info)
        app.router.add_route("HEAD", "/{owner}/{name}/resolve/{rev}/{path:.*}", self.resolve)
        app.router.add_get("/{owner}/{name}/resolve/{rev}/{path:.*}", self.resolve, allow_head=False)
        app.router.add_route("HEAD", "/cdn/{sha}", self.cdn)
        app.router.add_get("/cdn/{sha}", self.cdn, allow_head=False)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        # The CDN: the same app on another loopback address, so the client treats it as another host.
        await web.TCPSite(self._runner, CDN_HOST, self.port).start()
        return self.endpoint

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- helpers ---------------------------------------------------------------------------------

    def _record(self, request: web.Request) -> None:
        self.log.append(Logged(request.method, request.path, request.headers.get("Range"),
                               request.headers.get("Authorization") == f"Bearer {self.token}"))

    def _repo(self, request: web.Request) -> Repo:
        repo_id = f"{request.match_info['owner']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _error(404, "RepoNotFound", "Repository not found")
        auth = request.headers.get("Authorization")
        if repo.gated and auth != f"Bearer {self.token}":
            if auth is not None:
                raise _error(401, None, "Invalid credentials in Authorization header")
            raise _error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                           "to it and be authenticated to access it. Please log in.")
        rev = request.match_info.get("rev")
        if rev is not None and rev not in ("main", repo.sha):
            raise _error(404, "RevisionNotFound", f"Invalid rev id: {rev}", commit=None)
        return repo

    def _entry(self, f: HubFile) -> dict:
        entry = {"type": "file", "path": f.path, "size": len(f.data), "oid": f.blob_id}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
        return entry

    def _sign(self, sha: str) -> str:
        return hmac.new(self.secret, sha.encode(), hashlib.sha256).hexdigest()

    # -- routes ----------------------------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        self._record(request)
        repo = self._repo(request)
        return web.json_response({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "private": False,
                                  "gated": "manual" if repo.gated else False,
                                  "siblings": [{"rfilename": p} for p in sorted(repo.files)]})

    async def tree(self, request: web.Request) -> web.Response:
        self._record(request)
        repo = self._repo(request)
        base = request.match_info.get("path", "").strip("/")
        recursive = request.query.get("recursive", "false").lower() == "true"
        out, dirs = [], set()
        for path in sorted(repo.files):
            if base and not path.startswith(base + "/"):
                continue
            rest = path[len(base) + 1:] if base else path
            if "/" in rest and not recursive:
                dirs.add((f"{base}/" if base else "") + rest.split("/", 1)[0])
                continue
            if recursive:
                parts = path.split("/")[:-1]
                for i in range(len(base.split("/")) if base else 0, len(parts)):
                    dirs.add("/".join(parts[: i + 1]))
            out.append(self._entry(repo.files[path]))
        folders = [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()} for d in sorted(dirs)]
        return web.json_response(folders + out)

    async def paths_info(self, request: web.Request) -> web.Response:
        self._record(request)
        repo = self._repo(request)
        if request.content_type == "application/json":
            paths = (await request.json()).get("paths", [])
        else:
            paths = (await request.post()).getall("paths", [])
        return web.json_response([self._entry(repo.files[p]) for p in paths if p in repo.files])

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        repo = self._repo(request)
        path = request.match_info["path"]
        f = repo.files.get(path)
        if f is None or path in self.missing:
            raise _error(404, "EntryNotFound", f"{path} does not exist on \"main\"", commit=repo.sha)
        headers = {"X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes"}
        if f.lfs:
            location = f"http://{CDN_HOST}:{self.port}/cdn/{f.sha256}?signature={self._sign(f.sha256)}"
            headers |= {"Location": location, "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(len(f.data)),
                        "ETag": f'"{f.blob_id}"'}
            return web.Response(status=302, headers=headers)
        return await self._content(request, f, headers | {"ETag": f'"{f.blob_id}"'})

    async def cdn(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        sha = request.match_info["sha"]
        if not hmac.compare_digest(request.query.get("signature", ""), self._sign(sha)):
            return web.Response(status=403, text="bad signature")
        f = next((f for r in self.repos.values() for f in r.files.values() if f.lfs and f.sha256 == sha), None)
        if f is None:
            return web.Response(status=404)
        return await self._content(request, f, {"ETag": f'"{sha}"', "Accept-Ranges": "bytes"})

    async def _content(self, request: web.Request, f: HubFile, headers: dict) -> web.StreamResponse:
        data = f.data
        start = 0
        rng = request.headers.get("Range")
        if rng:
            start = int(rng.removeprefix("bytes=").split("-", 1)[0])
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            headers = headers | {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        body = data[start:]
        if request.method == "HEAD":
            return web.Response(status=206 if rng else 200, headers=headers | {"Content-Length": str(len(body))})
        resp = web.StreamResponse(status=206 if rng else 200, headers=headers)
        resp.content_length = len(body)
        cut = self.cut.pop(f.path, None) if not rng else None
        stall = self.stall.get(f.path) if not rng else None
        await resp.prepare(request)
        if cut is not None:
            await resp.write(body[:cut])
            await asyncio.sleep(0.05)  # let the bytes leave before the connection drops
            assert request.transport is not None
            request.transport.close()
            return resp
        if stall is not None:
            await resp.write(body[:stall])
            self.stalled.set()
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.05)  # held until the client goes away
            return resp
        await resp.write(body)
        await resp.write_eof()
        return resp


def _error(status: int, code: str | None, message: str, commit: str | None = None) -> web.HTTPException:
    headers = {"X-Error-Message": message}
    if code is not None:
        headers["X-Error-Code"] = code
    if commit is not None:
        headers["X-Repo-Commit"] = commit
    cls = {401: web.HTTPUnauthorized, 403: web.HTTPForbidden, 404: web.HTTPNotFound}[status]
    return cls(headers=headers, text=json.dumps({"error": message}), content_type="application/json")


@contextmanager
def running(hub: FakeHub) -> Iterator[FakeHub]:
    """Serve ``hub`` from a thread with its own event loop until the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(hub.start(), loop).result(timeout=30)
        yield hub
    finally:
        asyncio.run_coroutine_threadsafe(hub.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
