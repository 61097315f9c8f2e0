"""``lychee-rtc download``: the released Lychee-FD and Token2Wav folders from the Hugging Face Hub.

Both folders are fetched with ``huggingface_hub.snapshot_download`` and the model cards' include
patterns (``lychee_full_duplex/*`` of HIT-TMG/Lychee-FD, ``token2wav/*`` of
stepfun-ai/Step-Audio-2-mini), into the Hugging Face cache (where the profiles' ``hf://``
references find them) or, with ``--dir``, into a plain folder. What the library does is kept as it
is: its progress bars, ``HF_TOKEN`` (or a stored ``hf auth login`` token) for gated or private
repositories, ``HF_ENDPOINT`` for a mirror, ``HF_HUB_OFFLINE=1`` (or ``--offline``) to use the
cache only, and the resumption of a file whose connection dropped, from the byte it stopped at.
On top of it:

* a download that still fails for a passing reason (the connection, a 5xx, a timeout) is run
  again, up to ``--retries`` times with a growing pause; every run fetches only what the cache
  lacks, so a rerun after a killed download fetches only the missing files;
* partial files an interrupted run left in the cache are removed (only those no running download
  holds the lock of);
* errors that no retry mends (401, 403, a missing repository, revision or file) end the command
  with a message that says what to do;
* the result is checked against the released inventory (files, the 982 tensors with their
  shapes and dtype, Token2Wav's 605 + 328 tensors) from the headers, before it is reported done.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .hub import RELEASED_MODEL, RELEASED_VOCODER, HubFolder, HubReferenceError, cache_dir

PERMANENT_STATUS = {400, 401, 403, 404, 410}


class DownloadError(RuntimeError):
    """The download cannot complete; the message says why and what to do."""


@dataclass
class Fetched:
    kind: str  # model | token2wav
    ref: HubFolder
    folder: Path
    seconds: float


def _token_hint() -> str:
    if os.environ.get("HF_TOKEN"):
        return "the token in HF_TOKEN was refused: check that it may read this repository"
    return "set HF_TOKEN to a token that may read it (or log in once with `hf auth login`)"


def explain(exc: BaseException, ref: HubFolder, offline: bool = False) -> str | None:
    """A message for an error no retry mends, or None when the error may pass."""
    from huggingface_hub import errors

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{ref.repo_id} has no revision {ref.revision or 'main'!r} on {endpoint}"
    if isinstance(exc, errors.GatedRepoError):
        return f"{ref.repo_id} is gated on {endpoint} ({status}): {_token_hint()}, after accepting its terms"
    if isinstance(exc, errors.RepositoryNotFoundError):
        if status == 401:
            return (f"{endpoint} refused access to {ref.repo_id} (401): the repository is private or gated, or "
                    f"does not exist; {_token_hint()}")
        return f"{ref.repo_id} does not exist on {endpoint} ({status})"
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        url = str(getattr(getattr(exc, "response", None), "url", ""))
        name = url.split("/resolve/", 1)[-1].split("/", 1)[-1] if "/resolve/" in url else url
        return f"{ref.repo_id}: the Hub lists {name} but answers 404 for it; the repository changed, try again later"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        why = "offline mode is on (HF_HUB_OFFLINE or --offline)" if offline else "the Hub cannot be reached"
        return (f"{ref} is not complete in the cache ({cache_dir()}) and {why}; run the download with network "
                f"access ({str(exc).splitlines()[0]})")
    if status == 401:  # credentials the Hub did not accept
        said = getattr(exc, "response").headers.get("X-Error-Message") or str(exc).splitlines()[0]
        return f"{endpoint} refused access to {ref.repo_id} (401: {said}); {_token_hint()}"
    if status in PERMANENT_STATUS:
        return f"{ref.repo_id}: the Hub answered {status}: {str(exc).splitlines()[0]}"
    return None


def is_transient(exc: BaseException) -> bool:
    """Connection and server trouble that a later attempt may not meet."""
    from huggingface_hub import errors

    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status is None or status >= 500 or status in (408, 429)
    module = type(exc).__module__.split(".")[0]
    return isinstance(exc, (OSError, TimeoutError, ConnectionError)) or module in ("httpx", "httpx2", "httpcore",
                                                                                     "requests", "urllib3")


def remove_stale_partials(ref: HubFolder, local_dir: Path | None) -> int:
    """Delete partial files earlier, interrupted runs left for this repository; returns bytes freed.

    A partial file is removed only when no running download can be writing it: in the cache, when
    the lock of its blob (``.locks/<repo>/<etag>.lock``) can be taken at once; in a ``--dir``
    folder, whose partial files are named by a hash, only when every download lock of that folder
    (``DIR/.cache/huggingface/download/``) can be taken at once.
    """
    from contextlib import ExitStack

    from filelock import FileLock, Timeout
    from huggingface_hub.file_download import repo_folder_name

    freed = 0
    if local_dir is not None:
        folder = local_dir / ".cache" / "huggingface" / "download"
        partials = list(folder.rglob("*.incomplete")) if folder.is_dir() else []
        if not partials:
            return 0
        with ExitStack() as held:
            try:
                for lock in folder.rglob("*.lock"):
                    held.enter_context(FileLock(str(lock)).acquire(timeout=0))
            except (Timeout, OSError):
                return 0  # a download is running in this folder
            for partial in partials:
                freed += partial.stat().st_size
                partial.unlink(missing_ok=True)
        return freed
    repo = repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    blobs = Path(cache_dir()) / repo / "blobs"
    for partial in blobs.glob("*.incomplete"):
        etag = partial.name.split(".", 1)[0]
        lock = FileLock(str(Path(cache_dir()) / ".locks" / repo / f"{etag}.lock"))
        try:
            with lock.acquire(timeout=0):
                size = partial.stat().st_size
                partial.unlink(missing_ok=True)
                freed += size
        except (Timeout, OSError):
            continue
    return freed


def fetch(kind: str, ref: HubFolder, *, local_dir: Path | None, offline: bool, retries: int, workers: int,
          say: Callable[[str], None], sleep: Callable[[float], None] = time.sleep) -> Fetched:
    """Download one folder (retrying what may pass) and return where it is."""
    from huggingface_hub import snapshot_download

    t0 = time.monotonic()
    if not offline:
        freed = remove_stale_partials(ref, local_dir)
        if freed:
            say(f"removed {freed / 2**20:.1f} MiB of partial files an interrupted download left")
    attempt = 0
    while True:
        try:
            snapshot = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=ref.include,
                                         local_dir=str(local_dir) if local_dir else None,
                                         local_files_only=offline, max_workers=workers)
            break
        except Exception as exc:  # classified below; anything unknown is re-raised as is
            message = explain(exc, ref, offline)
            if message is not None:
                raise DownloadError(message) from None
            if not is_transient(exc):
                raise
            attempt += 1
            if attempt > retries:
                raise DownloadError(f"{ref}: still failing after {retries} retries: {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
            pause = min(60.0, 2.0 ** attempt)
            say(f"{ref}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
                f"retry {attempt} of {retries} in {pause:.0f} s (only what is missing is fetched)")
            sleep(pause)
    folder = ref.path_in(Path(snapshot))
    if not folder.is_dir() or not any(folder.iterdir()):
        raise DownloadError(f"{ref.repo_id} has no file matching {' '.join(ref.include)}: is {ref.folder!r} the "
                            f"right folder?")
    return Fetched(kind, ref, folder, time.monotonic() - t0)


def check(fetched: Fetched, released: bool) -> str:
    """The inventory check of one downloaded folder; returns a one-line summary."""
    gib = 2**30
    if fetched.kind == "model":
        from .inventory import verify_model_folder

        m = verify_model_folder(fetched.folder, released=released)
        return (f"{m.files} files, {m.bytes / gib:.2f} GiB, {m.tensors} tensors ({m.dtype}), "
                f"{m.params / 1e9:.2f} B parameters loaded, layout {m.layout}")
    from lychee_rtc.vocoder.token2wav.inventory import verify_token2wav_folder

    v = verify_token2wav_folder(fetched.folder, released=released)
    return (f"{v.files} files, {v.bytes / gib:.2f} GiB, flow.pt {v.flow_tensors} tensors, "
            f"hift.pt {v.hift_tensors} tensors, layout {v.layout}")


# --------------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", help="download into this folder instead of the Hugging Face cache "
                                      "(it gets lychee_full_duplex/ and token2wav/)")
    parser.add_argument("--only", choices=("model", "token2wav"), help="fetch one of the two")
    parser.add_argument("--model", default=str(RELEASED_MODEL),
                        help=f"Lychee-FD folder as hf://OWNER/NAME[@REVISION]/FOLDER (default {RELEASED_MODEL})")
    parser.add_argument("--token2wav", default=str(RELEASED_VOCODER),
                        help=f"Token2Wav folder (default {RELEASED_VOCODER})")
    parser.add_argument("--offline", action="store_true",
                        help="use the cache only, as HF_HUB_OFFLINE=1 does (checks what is there)")
    parser.add_argument("--retries", type=int, default=3,
                        help="runs again after a passing failure (connection, 5xx), each fetching only what "
                             "is missing (default 3)")
    parser.add_argument("--workers", type=int, default=8, help="files fetched at once (default 8)")
    parser.add_argument("--layout", choices=("released", "any"), default="released",
                        help="released (default): the folders must hold the released layout (982 tensors ...); "
                             "any: only consistent with their own config")


def run(args: argparse.Namespace) -> int:
    from huggingface_hub.errors import HFValidationError

    from lychee_rtc.vocoder.token2wav.config import CheckpointError

    from .inventory import InventoryError

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        wanted = [(kind, HubFolder.parse(value)) for kind, value in (("model", args.model),
                                                                        ("token2wav", args.token2wav))
                  if args.only in (None, kind)]
    except HubReferenceError as exc:
        say(f"lychee-rtc download: {exc}")
        return 2
    offline = args.offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    local_dir = Path(args.dir) if args.dir else None
    where = str(local_dir) if local_dir else f"the Hugging Face cache ({cache_dir()})"
    say(f"{'checking' if offline else 'fetching'} {', '.join(str(r) for _, r in wanted)} "
        f"{'in' if offline else 'into'} {where}")
    done: list[tuple[Fetched, str]] = []
    for kind, ref in wanted:
        try:
            fetched = fetch(kind, ref, local_dir=local_dir, offline=offline, retries=args.retries,
                            workers=args.workers, say=say)
            summary = check(fetched, args.layout == "released")
        except (DownloadError, HFValidationError) as exc:
            say(f"lychee-rtc download: {exc}")
            return 1
        except (InventoryError, CheckpointError) as exc:
            say(f"lychee-rtc download: {ref} arrived but does not match the released inventory: {exc}")
            return 1
        done.append((fetched, summary))
        print(f"{kind}: {fetched.folder} ({fetched.seconds:.1f} s): {summary}", flush=True)
    if local_dir is not None:
        keys = {"model": "engine.lychee.model_root", "token2wav": "engine.lychee.token2wav.folder"}
        print("serve it with these profile keys: " + ", ".join(f"{keys[f.kind]}: {f.folder}" for f, _ in done))
    elif all(ref in (RELEASED_MODEL, RELEASED_VOCODER) for _, ref in wanted):
        print("serve it: lychee-rtc serve --config lychee-c1 (or -c2, -c4); the profiles find it in the cache")
    return 0
