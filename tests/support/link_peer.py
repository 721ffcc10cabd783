"""Another user's client of the hook socket, for the attacks that need many connections held
open: it opens one websocket per entry of CONNECTIONS (a JSON list of lists of frames), sends
each frame and prints the answer (one JSON line: the frame's, or {"closed": true}; a frame
{"_close": I} closes connection I instead, one with "_retry_while": TEXT is sent again while the
answer's error holds TEXT), prints {"phase": "held"}, then waits for a line
on stdin and prints every frame any connection gets within LISTEN_S as {"got": ...}. Bounded:
every wait has a timeout.

    python link_peer.py UID SOCKET CONNECTIONS LISTEN_S    (started as root, drops to UID)
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import select
import sys

import aiohttp


def become(uid: int) -> None:
    """Drop to the other user for good (the test starts this as root)."""
    os.setgroups([])
    os.setgid(pwd.getpwuid(uid).pw_gid)
    os.setuid(uid)


async def main(path: str, connections: list[list[dict]], listen_s: float) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path, limit=0)) as session:
        held = []
        for frames in connections:
            ws = await session.ws_connect("http://localhost/v1/link", timeout=aiohttp.ClientWSTimeout(ws_close=1))
            held.append(ws)
            for frame in frames:
                if "_close" in frame:  # close an earlier connection (its job disconnects)
                    await held[frame["_close"]].close()
                    continue
                retry = frame.pop("_retry_while", "")
                for _ in range(50):  # until the agent has seen the close: bounded, 50 x 0.05 s
                    await ws.send_str(json.dumps(frame))
                    msg = await ws.receive(timeout=10)
                    answer = json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else {"closed": True}
                    if not retry or retry not in answer.get("error", ""):
                        break
                    await asyncio.sleep(0.05)
                print(json.dumps(answer))
        print(json.dumps({"phase": "held"}), flush=True)
        if select.select([sys.stdin], [], [], 60)[0]:  # the loop waits too: nothing is due meanwhile
            sys.stdin.readline()

        async def listen(ws: aiohttp.ClientWebSocketResponse) -> None:
            try:
                while True:
                    msg = await ws.receive(timeout=listen_s)
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        return
                    print(json.dumps({"got": json.loads(msg.data)}), flush=True)
            except TimeoutError:
                return

        await asyncio.gather(*(listen(ws) for ws in held))
        print(json.dumps({"phase": "done"}), flush=True)


if __name__ == "__main__":
    become(int(sys.argv.pop(1)))  # after the imports: the interpreter's files are root's
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])))
