"""Where the released weights live on the Hugging Face Hub, and finding them in the local cache.

A model folder in a profile is either a path or a Hub reference in the ``hf://`` form Hugging
Face's own file system uses::

    hf://HIT-TMG/Lychee-FD/lychee_full_duplex            # repository, then the folder inside it
    hf://stepfun-ai/Step-Audio-2-mini@<revision>/token2wav

A reference is resolved through the Hugging Face cache only (``HF_HUB_CACHE`` / ``HF_HOME``, as
``huggingface_hub`` reads them), never over the network, so serving starts the same with or
without a connection; a reference that is not cached is an error that says which
``lychee-rtc download`` fills it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SCHEME = "hf://"
_REPO = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
_REF = re.compile(rf"^{re.escape(SCHEME)}(?P<repo>{_REPO})(?:@(?P<rev>[^/]+))?(?:/(?P<folder>.*))?$")


class HubReferenceError(ValueError):
    """A malformed ``hf://`` reference, or one that is not in the local cache (the message says
    which command fetches it)."""


@dataclass(frozen=True)
class HubFolder:
    """A folder of a Hub model repository at a revision (None: the default branch)."""

    repo_id: str
    folder: str = ""
    revision: str | None = None

    @classmethod
    def parse(cls, ref: str) -> "HubFolder":
        m = _REF.match(ref.strip())
        if m is None:
            raise HubReferenceError(f"{ref!r} is not a Hub reference (hf://OWNER/NAME[@REVISION][/FOLDER])")
        folder = (m.group("folder") or "").strip("/")
        if ".." in folder.split("/"):
            raise HubReferenceError(f"{ref!r}: the folder may not leave the repository")
        return cls(m.group("repo"), folder, m.group("rev"))

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{SCHEME}{self.repo_id}{rev}" + (f"/{self.folder}" if self.folder else "")

    @property
    def include(self) -> list[str]:
        """The download's include patterns: everything under the folder (the release's own)."""
        return [f"{self.folder}/*"] if self.folder else ["*"]

    def path_in(self, snapshot: Path) -> Path:
        return snapshot / self.folder if self.folder else snapshot


# The released checkpoints, with the include patterns of their model cards.
RELEASED_MODEL = HubFolder("HIT-TMG/Lychee-FD", "lychee_full_duplex")
RELEASED_VOCODER = HubFolder("stepfun-ai/Step-Audio-2-mini", "token2wav")

# A file that is in the folder of a complete download (the first one a loader opens).
MARKERS = {"model": "config.json", "token2wav": "flow.yaml"}


def is_hub_reference(value: object) -> bool:
    return isinstance(value, str) and value.strip().startswith(SCHEME)


def download_command(model: HubFolder | None = None, token2wav: HubFolder | None = None) -> str:
    """The ``lychee-rtc download`` line that fetches these folders into the cache (the released ones
    are fetched together, as a fresh machine needs both)."""
    words = ["lychee-rtc", "download"]
    if model not in (None, RELEASED_MODEL):
        words += ["--model", str(model)] + (["--only", "model"] if token2wav is None else [])
    if token2wav not in (None, RELEASED_VOCODER):
        words += ["--token2wav", str(token2wav)] + (["--only", "token2wav"] if model is None else [])
    return " ".join(words)


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_folder(ref: HubFolder, marker: str) -> Path | None:
    """The folder's path in the local cache, or None when its ``marker`` file is not there. No network."""
    from huggingface_hub import try_to_load_from_cache

    name = f"{ref.folder}/{marker}" if ref.folder else marker
    found = try_to_load_from_cache(ref.repo_id, name, revision=ref.revision)
    if not isinstance(found, str):  # None, or the cache's "known not to exist" marker
        return None
    return Path(found).parent


def resolve_folder(value: str, key: str, kind: str) -> Path:
    """A profile's folder value (a path or an ``hf://`` reference) as a local path.

    ``kind`` is ``model`` or ``token2wav`` (which download fills it); ``key`` names the profile key
    in errors.
    """
    if not is_hub_reference(value):
        return Path(value)
    try:
        ref = HubFolder.parse(value)
    except HubReferenceError as exc:
        raise HubReferenceError(f"{key}: {exc}") from None
    try:
        folder = cached_folder(ref, MARKERS[kind])
    except ImportError as exc:
        raise HubReferenceError(f"{key}: {value} needs huggingface_hub (the model extra): {exc}") from None
    if folder is None:
        command = download_command(model=ref) if kind == "model" else download_command(token2wav=ref)
        raise HubReferenceError(
            f"{key}: {value} is not in the Hugging Face cache ({cache_dir()}); fetch it with `{command}` "
            f"(or point {key} at a folder)")
    return folder
