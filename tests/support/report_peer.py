"""Another user's job on the hook socket, for the attacks on what a job's reports may make the
agent do: it reads a JSON list of frames from stdin, opens one websocket, sends each frame in
order (waiting for the answer of each registration), then sends its first registration again as
a barrier: the agent handles one connection's frames in order, so that answer means every frame
before it was taken. It prints one JSON line per answer ({"closed": true} when the connection
ended) and exits. Bounded: every wait has a timeout.

    python report_peer.py UID SOCKET < frames.json      (started as root, drops to UID)
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import sys

import aiohttp


def become(uid: int) -> None:
    """Drop to the other user for good (the test starts this as root)."""
    os.setgroups([])
    os.setgid(pwd.getpwuid(uid).pw_gid)
    os.setuid(uid)


async def answer(ws: aiohttp.ClientWebSocketResponse) -> dict:
    msg = await ws.receive(timeout=60)
    return json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else {"closed": True}


async def main(path: str, frames: list[dict]) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
        ws = await session.ws_connect("http://localhost/v1/link", timeout=aiohttp.ClientWSTimeout(ws_close=1))
        first = next(f for f in frames if f["type"] == "register")
        for frame in [*frames, first]:
            await ws.send_str(json.dumps(frame))
            while frame["type"] == "register":  # its answer, after any error frame of the reports before it
                got = await answer(ws)
                print(json.dumps(got), flush=True)
                if got.get("type") != "error":
                    break
        await ws.close()


if __name__ == "__main__":
    become(int(sys.argv.pop(1)))  # after the imports: the interpreter's files are root's
    asyncio.run(main(sys.argv[1], json.loads(sys.stdin.read())))
