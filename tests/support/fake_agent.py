"""A fake agent on a Unix socket, run by the tests as another user who swapped the real
agent's socket for its own: it answers the link's websocket, sends a rollback at once and
prints every frame it gets (one JSON line each), so the test sees what a job told it.

    python fake_agent.py UID SOCKET SECONDS    (started as root, drops to UID)
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import sys

from aiohttp import WSMsgType, web


def become(uid: int) -> None:
    """Drop to the other user for good (the test starts this as root)."""
    os.setgroups([])
    os.setgid(pwd.getpwuid(uid).pw_gid)
    os.setuid(uid)


async def handle(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    print(json.dumps({"connected": True}), flush=True)
    await ws.send_str(json.dumps({"type": "heal", "action": "rollback", "id": "fake"}))
    async for msg in ws:
        if msg.type == WSMsgType.TEXT:
            print(json.dumps({"frame": json.loads(msg.data)}), flush=True)
    return ws


async def main(path: str, seconds: float) -> None:
    app = web.Application()
    app.router.add_get("/v1/link", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    os.chmod(path, 0o666)  # anyone may connect: the attacker wants the job to
    print(json.dumps({"ready": os.getuid()}), flush=True)
    await asyncio.sleep(seconds)  # bounded: the test stops it earlier
    await runner.cleanup()


if __name__ == "__main__":
    become(int(sys.argv.pop(1)))  # after the imports: the interpreter's files are root's
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
