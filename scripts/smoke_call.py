"""Place one WebRTC call against a running server and check that it is carried both ways.

    python scripts/smoke_call.py http://127.0.0.1:8080

Uses only the default install (aiortc through lychee_rtc.bench.client). Exit status 0 when the
call connected, the session was announced on the data channel and outbound audio arrived.
"""

from __future__ import annotations

import asyncio
import sys

from lychee_rtc.bench.client import RtcClient


async def smoke(url: str) -> None:
    client = RtcClient(url)
    try:
        await client.connect(session={"metrics": True})
        created = await client.wait_event("session.created", timeout=30)
        for _ in range(300):  # the server's track sends frames (silence at first) from the start
            if client.received.chunks:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("no audio arrived from the server within 30 s")
        client.send({"type": "session.close"})
        await client.wait_event("session.closed", timeout=30)
        print(f"call {created['session']['id']} carried: {len(client.received.chunks)} audio frames, "
              f"{len(client.events)} events")
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(smoke(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"))
