"""Files the server reads at run time: the web client, the wire contract and the shipped profiles.

In a source checkout they are the repository's top-level ``web/``, ``signaling/`` and ``configs/``
folders. A wheel carries copies of them inside the package (``lychee_rtc/_share/``, written by the
build, see ``setup.py``), so an installed server needs no checkout.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
SHARED_FOLDERS = ("web", "signaling", "configs")


def shared_path(folder: str) -> Path:
    """The folder ``folder`` (one of ``SHARED_FOLDERS``) as shipped in the wheel, else in the checkout."""
    if folder not in SHARED_FOLDERS:
        raise ValueError(f"{folder!r} is not a shipped folder ({', '.join(SHARED_FOLDERS)})")
    bundled = PACKAGE_ROOT / "_share" / folder
    return bundled if bundled.is_dir() else REPO_ROOT / folder


def shipped_profile(name: str) -> Path | None:
    """A profile shipped with the server, by name (``loopback``, ``lychee-c4.yaml``), or None."""
    if not name or "/" in name or "\\" in name:
        return None
    stem = name[:-5] if name.endswith(".yaml") else name
    path = shared_path("configs") / f"{stem}.yaml"
    return path if path.is_file() else None
