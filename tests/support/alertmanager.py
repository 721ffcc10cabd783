"""A real Alertmanager the tests start on 127.0.0.1, and its config adapted to a test webhook."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import aiohttp
import yaml

from support import REPO, free_port, require_tool, stop_process

SHIPPED = REPO / "mscale" / "rules" / "alertmanager.yml"


def adapted_config(webhook_url: str, token_file: Path, *, group_wait: str = "0s", group_interval: str = "1s") -> str:
    """The shipped routing with the receivers pointed at a test URL and token, and timings short
    enough for a test. Routes, grouping, matchers and inhibition stay as shipped."""
    cfg = yaml.safe_load(SHIPPED.read_text())
    for r in cfg["receivers"]:
        for hook in r["webhook_configs"]:
            hook["url"] = webhook_url
            hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    for route in [cfg["route"], *cfg["route"]["routes"]]:
        route.update(group_wait=group_wait, group_interval=group_interval)
    return yaml.safe_dump(cfg, sort_keys=False)


class Alertmanager:
    """A real Alertmanager on 127.0.0.1 with its own temp dir, stopped by PID."""

    def __init__(self, config_text: str, tmp: Path) -> None:
        self.binary = require_tool("prometheus-alertmanager")
        self.dir = tmp / "am"
        self.dir.mkdir()
        (self.dir / "alertmanager.yml").write_text(config_text)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Alertmanager:
        self.log = open(self.dir / "log", "w")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.dir / 'alertmanager.yml'}",
                f"--storage.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
                "--log.level=debug",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        return self

    def __exit__(self, *exc) -> None:
        if self.proc:
            stop_process(self.proc)
        self.log.close()

    def logs(self) -> str:
        return (self.dir / "log").read_text()[-4000:]

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"alertmanager exited: {self.logs()}"
            try:
                async with session.get(f"{self.url}/-/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"alertmanager not ready: {self.logs()}")
