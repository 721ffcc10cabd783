"""Loading the CUDA BPF program and attaching it to one process's libcuda and libcudart.

Split from probes/ebpf.py so the benchmark can drive the same programs and attachments.
BCC is imported only inside `CudaBpf` (never at import time).

Attaching: each role (a BPF function and the driver symbols it handles) is attached to one
process with one `uprobe_multi` BPF link (Linux 6.6+) where the kernel has it, else with
BCC's one-perf-event-per-symbol uprobes. The difference matters for duty cycling: closing
a uprobe waits for an RCU grace period (about 0.1 s here), and perf-event uprobes are
closed one by one under a kernel mutex, while a multi link releases all its uprobes
after one wait.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from mscale.probes.base import ProbeUnavailable

log = structlog.get_logger("mscale.probes.ebpf")

SOURCE = Path(__file__).with_name("ebpf_cuda.bpf.c")
DIRECTIONS = ("htod", "dtoh", "dtod", "default")  # index order of copies[] in the BPF C
HIST_SLOTS = 64
SYNC_KINDS = {1: "cuStreamSynchronize", 2: "cuCtxSynchronize", 3: "cuEventSynchronize"}
DRIVER, RUNTIME = "driver", "runtime"  # libcuda, libcudart


@dataclass(frozen=True)
class Role:
    prog: str  # BPF function in ebpf_cuda.bpf.c
    symbols: tuple[str, ...]  # entry points it handles, where the library exports them
    retprobe: bool = False
    high_rate: bool = False  # duty-cycled (launch, copy); the others stay attached
    library: str = DRIVER  # DRIVER (libcuda) or RUNTIME (libcudart)


ROLES: tuple[Role, ...] = (
    Role(
        "on_launch",
        ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"),
        high_rate=True,
    ),
    Role("on_graph_launch", ("cuGraphLaunch", "cuGraphLaunch_ptsz"), high_rate=True),
    Role("on_copy_htod", ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz"), high_rate=True),
    Role("on_copy_htod32", ("cuMemcpyHtoDAsync",), high_rate=True),
    Role("on_copy_dtoh", ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz"), high_rate=True),
    Role("on_copy_dtoh32", ("cuMemcpyDtoHAsync",), high_rate=True),
    Role("on_copy_dtod", ("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz"), high_rate=True),
    Role("on_copy_dtod32", ("cuMemcpyDtoDAsync",), high_rate=True),
    Role("on_copy_default", ("cuMemcpyAsync", "cuMemcpyAsync_ptsz"), high_rate=True),
    Role("on_stream_sync", ("cuStreamSynchronize", "cuStreamSynchronize_ptsz")),
    Role("on_ctx_sync", ("cuCtxSynchronize",)),
    Role("on_event_sync", ("cuEventSynchronize",)),
    Role(
        "on_sync_return",
        ("cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize"),
        retprobe=True,
    ),
    Role("on_alloc", ("cuMemAlloc_v2",)),
    Role("on_alloc32", ("cuMemAlloc",)),
    Role("on_alloc_return", ("cuMemAlloc_v2", "cuMemAlloc"), retprobe=True),
    # the runtime: each call counts here and marks its thread, so the driver calls it makes
    # are not counted again (ebpf_cuda.bpf.c)
    Role(
        "on_rt_launch",
        ("cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC", "cudaLaunchKernelExC_ptsz"),
        high_rate=True,
        library=RUNTIME,
    ),
    Role("on_rt_graph_launch", ("cudaGraphLaunch", "cudaGraphLaunch_ptsz"), high_rate=True, library=RUNTIME),
    Role("on_rt_copy", ("cudaMemcpyAsync", "cudaMemcpyAsync_ptsz"), high_rate=True, library=RUNTIME),
    Role(
        "on_rt_return",
        (
            "cudaLaunchKernel",
            "cudaLaunchKernel_ptsz",
            "cudaLaunchKernelExC",
            "cudaLaunchKernelExC_ptsz",
            "cudaGraphLaunch",
            "cudaGraphLaunch_ptsz",
            "cudaMemcpyAsync",
            "cudaMemcpyAsync_ptsz",
        ),
        retprobe=True,
        high_rate=True,
        library=RUNTIME,
    ),
    Role("on_rt_stream_sync", ("cudaStreamSynchronize", "cudaStreamSynchronize_ptsz"), library=RUNTIME),
    Role("on_rt_device_sync", ("cudaDeviceSynchronize",), library=RUNTIME),
    Role("on_rt_event_sync", ("cudaEventSynchronize",), library=RUNTIME),
    Role(
        "on_rt_sync_return",
        ("cudaStreamSynchronize", "cudaStreamSynchronize_ptsz", "cudaDeviceSynchronize", "cudaEventSynchronize"),
        retprobe=True,
        library=RUNTIME,
    ),
)
# else it is not that library
REQUIRED_SYMBOLS = {DRIVER: ("cuLaunchKernel", "cuStreamSynchronize"), RUNTIME: ("cudaLaunchKernel",)}
_LIBRARY_NAME = {DRIVER: "CUDA driver", RUNTIME: "CUDA runtime"}

_LAUNCH_PROGS = ("on_launch", "on_rt_launch", "on_rt_return")  # a launch, counted once
_TOKEN = re.compile(r"@@([A-Z_][A-Z0-9_]*)@@")


def specialise(text: str, tokens: dict[str, Any]) -> str:
    """Fill the @@NAME@@ tokens of the BPF C from an explicit map. A token the map lacks,
    or a map entry the text does not use, is an error: nothing is left to chance."""
    used = set(_TOKEN.findall(text))
    missing = sorted(used - set(tokens))
    if missing:
        raise ValueError(f"BPF source has tokens with no value: {', '.join(missing)}")
    unused = sorted(set(tokens) - used)
    if unused:
        raise ValueError(f"token values not used by the BPF source: {', '.join(unused)}")
    out = _TOKEN.sub(lambda m: str(tokens[m.group(1)]), text)
    left = _TOKEN.findall(out)  # a value that itself looked like a token
    if left:
        raise ValueError(f"tokens left after specialisation: {', '.join(sorted(set(left)))}")
    return out


# --- what the machine allows ----------------------------------------------------------

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39


def effective_caps(status_path: str = "/proc/self/status") -> int:
    for line in Path(status_path).read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def preflight() -> None:
    """Raise ProbeUnavailable naming what is missing: BCC, capabilities, kernel headers."""
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        raise ProbeUnavailable(f"BCC is not importable ({e}); install python3-bpfcc") from None
    caps = effective_caps()

    def has(c: int) -> bool:
        return bool(caps >> c & 1)

    missing = [name for name, c in (("CAP_BPF", CAP_BPF), ("CAP_PERFMON", CAP_PERFMON)) if not has(c)]
    if missing and not has(CAP_SYS_ADMIN):
        raise ProbeUnavailable(
            f"no BPF permission: the agent lacks {' and '.join(missing)} "
            f"(or CAP_SYS_ADMIN); effective capabilities {caps:#x}"
        )
    release = platform.release()
    candidates = [
        os.environ.get("BCC_KERNEL_SOURCE", ""),
        f"/lib/modules/{release}/build",
        f"/lib/modules/{release}/source",
        "/sys/kernel/kheaders.tar.xz",
    ]
    if not any(c and os.path.exists(c) for c in candidates):
        raise ProbeUnavailable(
            f"no kernel headers for {release}: install linux-headers-{release} "
            "or load the kheaders module (BCC compiles against them)"
        )


# --- uprobe_multi links through the bpf() syscall -------------------------------------

_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
_BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48
_BPF_F_UPROBE_MULTI_RETURN = 1
_FALLBACK_ERRNOS = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.E2BIG, 524}  # 524: ENOTSUPP


class _LinkCreateAttr(ct.Structure):
    """union bpf_attr, the BPF_LINK_CREATE member with its uprobe_multi part."""

    _fields_ = [
        ("prog_fd", ct.c_uint32),
        ("target_fd", ct.c_uint32),
        ("attach_type", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("path", ct.c_uint64),
        ("offsets", ct.c_uint64),
        ("ref_ctr_offsets", ct.c_uint64),
        ("cookies", ct.c_uint64),
        ("cnt", ct.c_uint32),
        ("multi_flags", ct.c_uint32),
        ("pid", ct.c_uint32),
        ("_tail", ct.c_uint8 * 68),
    ]


def _link_uprobe_multi(prog_fd: int, path: str, offsets: list[int], pid: int, retprobe: bool) -> int:
    if _SYS_BPF is None:
        raise OSError(errno.ENOSYS, f"no bpf() syscall number for {platform.machine()}")
    libc = ct.CDLL(None, use_errno=True)
    attr = _LinkCreateAttr()
    path_buf = ct.create_string_buffer(os.fsencode(path))
    offs = (ct.c_uint64 * len(offsets))(*offsets)
    attr.prog_fd, attr.attach_type = prog_fd, BPF_TRACE_UPROBE_MULTI
    attr.path = ct.cast(path_buf, ct.c_void_p).value
    attr.offsets = ct.cast(offs, ct.c_void_p).value
    attr.cnt, attr.pid = len(offsets), pid
    attr.multi_flags = _BPF_F_UPROBE_MULTI_RETURN if retprobe else 0
    fd = libc.syscall(ct.c_long(_SYS_BPF), ct.c_int(_BPF_LINK_CREATE), ct.byref(attr), ct.c_uint(ct.sizeof(attr)))
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return fd


# --- the loaded program -------------------------------------------------------------------


@dataclass(frozen=True)
class PidCounters:
    """One read of a process's `stats` entry."""

    launches: int
    graph_launches: int
    last_launch_ns: int
    copies: tuple[int, ...]
    copy_bytes: tuple[int, ...]
    sync_calls: int
    sync_ns: int
    alloc_calls: int
    alloc_failures: int
    last_alloc_fail_bytes: int
    last_alloc_error: int
    sync_hist: tuple[int, ...]


@dataclass(frozen=True)
class InflightSync:
    tid: int
    pid: int
    entered_ns: int
    kind: str


@dataclass
class Link:
    """What one attach made: a multi-link fd, or BCC perf-event names."""

    role: Role
    fd: int | None = None
    events: list[bytes] = field(default_factory=list)


class CudaBpf:
    """The compiled program, its maps, and attach/detach by (pid, library, role)."""

    def __init__(self, *, max_pids: int = 256, max_threads: int = 8192, attach_mode: str = "auto") -> None:
        from bcc import BPF  # the caller ran preflight()

        self._BPF = BPF
        text = specialise(SOURCE.read_text(), {"MAX_PIDS": max_pids, "MAX_THREADS": max_threads})
        self.bpf = BPF(text=text.encode())
        self.stats = self.bpf[b"stats"]
        self.inflight = self.bpf[b"inflight"]
        self.alloc_req = self.bpf[b"alloc_req"]
        self.in_runtime = self.bpf[b"in_runtime"]
        if attach_mode not in ("auto", "uprobe_multi", "perf_event"):
            raise ValueError(f"attach_mode: expected auto, uprobe_multi or perf_event, got {attach_mode!r}")
        # None: the first attach finds out whether the kernel has uprobe_multi links
        self.multi: bool | None = False if attach_mode == "perf_event" else None
        self.strict = attach_mode == "uprobe_multi"  # no fallback: an error says why
        self.fallback_reason = ""
        self._symbols: dict[tuple, dict[str, list[int]]] = {}

    @property
    def attach_mode(self) -> str:
        return {True: "uprobe_multi", False: "perf_event", None: "unknown"}[self.multi]

    # symbols -------------------------------------------------------------------------
    def offsets(self, path: str, library: str = DRIVER) -> dict[str, list[int]]:
        """role.prog -> file offsets of its symbols in this library (cached per file), for
        the roles of `library` (DRIVER or RUNTIME)."""
        st = os.stat(path)
        key = (path, st.st_dev, st.st_ino, st.st_mtime_ns, library)
        if key not in self._symbols:
            roles = [r for r in ROLES if r.library == library]
            wanted = {s for r in roles for s in r.symbols}
            names = {n.decode() for n, _ in self._BPF.get_user_functions_and_addresses(path.encode(), b".*")} & wanted
            missing = [s for s in REQUIRED_SYMBOLS[library] if s not in names]
            if missing:
                raise ValueError(f"{path} does not export {', '.join(missing)}: not a {_LIBRARY_NAME[library]} library")
            resolved: dict[str, int] = {}
            for name in sorted(names):
                resolved[name] = self._BPF._check_path_symbol(path.encode(), name.encode(), 0, -1)[1]
            out: dict[str, list[int]] = {}
            for role in roles:
                seen: set[int] = set()
                offs = []
                for s in role.symbols:  # aliases at one address: one uprobe, one count
                    if s in resolved and resolved[s] not in seen:
                        seen.add(resolved[s])
                        offs.append(resolved[s])
                out[role.prog] = offs
            self._symbols[key] = out
        return self._symbols[key]

    # attach --------------------------------------------------------------------------
    def attach(self, pid: int, path: str, role: Role, offsets: list[int]) -> Link:
        if self.multi is not False:
            try:
                fn = self.bpf.load_func(role.prog.encode(), self._BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
                fd = _link_uprobe_multi(fn.fd, path, offsets, pid, role.retprobe)
                self.multi = True
                return Link(role, fd=fd)
            except OSError as e:
                if self.multi or self.strict or e.errno not in _FALLBACK_ERRNOS:
                    raise
                self._fall_back(f"uprobe_multi link refused: {e.strerror}")
            except Exception as e:  # BCC: the kernel refused the attach type at load
                if self.multi or self.strict:
                    raise
                self._fall_back(f"uprobe_multi program load refused: {e}")
        link = Link(role)
        try:
            for off in offsets:
                before = set(self.bpf.uprobe_fds)  # BCC names the event after the path it resolved
                if role.retprobe:
                    self.bpf.attach_uretprobe(name=path.encode(), addr=off, fn_name=role.prog.encode(), pid=pid)
                else:
                    self.bpf.attach_uprobe(name=path.encode(), addr=off, fn_name=role.prog.encode(), pid=pid)
                link.events.extend(set(self.bpf.uprobe_fds) - before)
        except Exception:
            self.detach(link)
            raise
        return link

    def attach_launches(self, pid: int, driver: str, runtime: str | None = None) -> list[Link]:
        """Only the kernel-launch probes, on the driver and (when given) the runtime, with
        the runtime's return probe that keeps a runtime launch from counting twice: what
        the device check and the benchmark compare against a profiler."""
        links: list[Link] = []
        try:
            for library, path in ((DRIVER, driver), (RUNTIME, runtime)):
                if path is None:
                    continue
                offsets = self.offsets(path, library)
                for role in ROLES:
                    if role.library == library and role.prog in _LAUNCH_PROGS and offsets[role.prog]:
                        links.append(self.attach(pid, path, role, offsets[role.prog]))
        except Exception:
            for link in links:
                self.detach(link)
            raise
        return links

    def _fall_back(self, reason: str) -> None:
        self.multi, self.fallback_reason = False, reason
        log.info("ebpf_attach_fallback", mode="perf_event", reason=reason)
        for name in [n for n in self.bpf.funcs]:  # loaded for multi links: reload plain
            os.close(self.bpf.funcs.pop(name).fd)

    def detach(self, link: Link) -> None:
        if link.fd is not None:
            os.close(link.fd)
            link.fd = None
        for ev in link.events:
            if ev in self.bpf.uprobe_fds:
                self.bpf.detach_uprobe_event(ev)
        link.events.clear()

    # maps ----------------------------------------------------------------------------
    def add_pid(self, pid: int) -> None:
        key = self.stats.Key(pid)
        if self.stats.get(key) is None:
            self.stats[key] = self.stats.Leaf()

    def remove_pid(self, pid: int) -> None:
        try:
            del self.stats[self.stats.Key(pid)]
        except KeyError:
            pass
        for table in (self.inflight, self.alloc_req, self.in_runtime):
            for k in [k for k in table.keys() if k.value >> 32 == pid]:
                try:
                    del table[k]
                except KeyError:
                    pass

    def forget_thread(self, tid_key: int) -> None:
        for table in (self.inflight, self.alloc_req, self.in_runtime):
            try:
                del table[table.Key(tid_key)]
            except KeyError:
                pass

    def read_stats(self) -> dict[int, PidCounters]:
        out = {}
        for k, v in self.stats.items():
            out[k.value] = PidCounters(
                v.launches,
                v.graph_launches,
                v.last_launch_ns,
                tuple(v.copies),
                tuple(v.copy_bytes),
                v.sync_calls,
                v.sync_ns,
                v.alloc_calls,
                v.alloc_failures,
                v.last_alloc_fail_bytes,
                v.last_alloc_error,
                tuple(v.sync_hist),
            )
        return out

    def read_inflight(self) -> list[InflightSync]:
        return [
            InflightSync(k.value & 0xFFFFFFFF, k.value >> 32, v.ts, SYNC_KINDS.get(v.kind, "?"))
            for k, v in self.inflight.items()
        ]

    def map_pids(self) -> set[int]:
        """Every process id with an entry in any map (tests check exits leave none)."""
        pids = {k.value for k in self.stats.keys()}
        for table in (self.inflight, self.alloc_req, self.in_runtime):
            pids |= {k.value >> 32 for k in table.keys()}
        return pids

    def close(self, links: Iterable[Link] = ()) -> None:
        for link in links:
            try:
                self.detach(link)
            except Exception:
                log.warning("ebpf_detach_failed", role=link.role.prog, exc_info=True)
        self.bpf.cleanup()
