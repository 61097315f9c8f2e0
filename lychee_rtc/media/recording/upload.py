"""Finished recordings copied to S3-compatible object storage (``recording.s3``), through boto3.

The upload runs on the recording's writer thread once its files are closed, never on the event
loop; a failure is logged and written into the recording's meta, and the local copy stays (local
retention still applies). boto3 is the optional ``s3`` extra.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lychee_rtc.config import ConfigError, RecordingS3Settings

log = logging.getLogger(__name__)

CONTENT_TYPES = {"audio.ogg": "audio/ogg; codecs=opus", "events.jsonl": "application/x-ndjson",
                 "meta.json": "application/json"}


class MissingS3Library(ConfigError):
    """Start-up stops with this (cli): the profile asks for uploads that cannot happen."""


class S3Uploader:
    def __init__(self, settings: RecordingS3Settings) -> None:
        try:
            import boto3
        except ImportError:
            raise MissingS3Library("recording.s3 needs boto3: install lychee-rtc[s3]") from None
        self.settings = settings
        self._client: Any = boto3.client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region,
            aws_access_key_id=settings.access_key_id, aws_secret_access_key=settings.secret_access_key)

    def key(self, session_id: str, name: str) -> str:
        return f"{self.settings.prefix}{session_id}/{name}"

    def upload(self, folder: Path) -> str:
        """Copy the recording's files; returns the s3:// location of its folder."""
        for name, content_type in CONTENT_TYPES.items():
            path = folder / name
            if path.is_file():
                self._client.upload_file(str(path), self.settings.bucket, self.key(folder.name, name),
                                         ExtraArgs={"ContentType": content_type})
        location = f"s3://{self.settings.bucket}/{self.key(folder.name, '')}"
        log.info("recording %s uploaded to %s", folder.name, location)
        return location
