"""Peer watchdog: when a rank dies, the job stops within a bounded time and says which rank it was.

Without it a dead rank shows up on the others as a bare "Connection closed by peer" from gloo (or,
with NCCL, as a collective that waits until the process-group timeout, 30 minutes by default), and
DeepSpeed's launcher names the wrong process (``launch.py`` logs the command of the last rank it
started, not of the one that exited). The watchdog adds, per rank:

- a heartbeat: a thread bumps the counter ``ds_longseq/hb/<rank>`` in the job's rendezvous store
  (the TCPStore rank 0 hosts) every ``heartbeat_s``, on its own connection to it;
- on rank 0, a monitor: a rank whose counter has not moved for ``peer_timeout_s`` is declared gone,
  the job is stopped (every rank exits with :data:`PEER_GONE_EXIT_CODE`) and the message names it:
  that bounds the hang of a collective that waits on a dead rank;
- on every rank, a census when the rank is about to die anyway (an uncaught exception, e.g. gloo's
  "Connection closed by peer", or SIGTERM from its launcher): it watches the counters for
  ``census_s`` and names the ranks whose counters stood still, before the usual traceback;
- ``PR_SET_PDEATHSIG``: a rank dies with its launcher (a node's ``launch.py`` or MPI proxy killed),
  instead of training on, unsupervised, as an orphan;
- rank 0, whose process hosts the store, waits at exit (bounded) for the other ranks to finish,
  so that a normal end is never mistaken for its death.

A rank that exits normally marks its counter ``done`` first and is never reported. The watchdog runs
only in processes a launcher started (deepspeed, torchrun, mpirun, srun): those that a test or a
notebook spawns itself, whose ranks may end at any time, have none unless they call
:func:`start_watchdog` themselves.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from ds_longseq.compat import default_process_group, default_store
from ds_longseq.processes.process_group import launcher_environment

__all__ = ["PeerWatch", "RankInfo", "start_watchdog", "active_watch", "started_by_launcher", "PEER_GONE_EXIT_CODE"]

PEER_GONE_EXIT_CODE = 75
"""Exit status of every rank the watchdog stops (EX_TEMPFAIL: resume from the last checkpoint)."""

_PREFIX = "ds_longseq/watch"
_DONE = b"done"
_PR_SET_PDEATHSIG = 1


def started_by_launcher() -> bool:
    """Whether this process was started by a launcher (deepspeed, torchrun, mpirun, srun)."""
    return launcher_environment() not in (None, "env")


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(PEER_GONE_EXIT_CODE)
    return True


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs, as it registered itself."""

    rank: int
    host: str
    pid: int
    node: str
    local_rank: str

    @classmethod
    def here(cls, rank: int) -> "RankInfo":
        node = next((os.environ[k] for k in ("CROSS_RANK", "GROUP_RANK", "OMPI_COMM_WORLD_NODE_RANK", "SLURM_NODEID")
                     if k in os.environ), "?")
        return cls(rank, socket.gethostname(), os.getpid(), node, os.environ.get("LOCAL_RANK", "?"))

    def encode(self) -> str:
        return f"{self.rank}\t{self.host}\t{self.pid}\t{self.node}\t{self.local_rank}"

    @classmethod
    def decode(cls, text: str) -> "RankInfo":
        rank, host, pid, node, local = text.split("\t")
        return cls(int(rank), host, int(pid), node, local)

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}, node {self.node}, local rank {self.local_rank}, pid {self.pid})"


class PeerWatch:
    """The heartbeat, monitor and census of one rank (see the module docstring).

    Args:
        store: this process's TCPStore of the job (cloned: the watch uses its own connections; the
            reference kept to it also keeps rank 0's server alive until the process ends).
        rank, world_size: this process's global rank and the job's size.
        heartbeat_s: seconds between heartbeats.
        peer_timeout_s: rank 0 stops the job when a rank's heartbeat stood still this long.
        census_s: how long a dying rank watches the counters to tell the dead from the living
            (default: 3 heartbeats, at least 3 s).
    """

    def __init__(self, store, rank: int, world_size: int, heartbeat_s: float = 1.0, peer_timeout_s: float = 120.0,
                 census_s: float | None = None):
        if heartbeat_s <= 0 or peer_timeout_s <= heartbeat_s:
            raise ValueError(f"need 0 < heartbeat_s < peer_timeout_s, got {heartbeat_s}, {peer_timeout_s}")
        self.rank, self.world_size = rank, world_size
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self.census_s = census_s if census_s is not None else max(3 * heartbeat_s, 3.0)
        self._template = store
        self._store = self._clone()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._infos: dict[int, RankInfo] = {}
        self._rank0_done = False
        self._in_census = False
        self._reported = False
        self._failed = False
        self._prev_excepthook = None
        self._prev_sigterm = None
        self._group = default_process_group()

    # -- keys ------------------------------------------------------------------------------------

    @staticmethod
    def _hb(rank: int) -> str:
        return f"{_PREFIX}/hb/{rank}"

    def _clone(self, timeout_s: float | None = None):
        store = self._template.clone()
        store.set_timeout(timedelta(seconds=timeout_s or max(10.0, 5 * self.heartbeat_s)))
        return store

    # -- life cycle ------------------------------------------------------------------------------

    def register(self) -> None:
        """Publish this rank's info and a zero heartbeat (call on every rank, then a barrier, then start)."""
        self._store.set(f"{_PREFIX}/info/{self.rank}", RankInfo.here(self.rank).encode())
        self._store.set(self._hb(self.rank), "0")

    def start(self, handle_exits: bool = True) -> None:
        """Start the heartbeat thread; with ``handle_exits``, also the census on uncaught exceptions and
        SIGTERM and the normal-exit handshake (atexit)."""
        if self.rank != 0:  # rank 0's details, for the message when its store (and so the census) is gone
            self._describe([0])
        self._thread = threading.Thread(target=self._run, name=f"ds_longseq-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        if handle_exits:
            self._prev_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
            if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
                signal.SIG_DFL, None
            ):
                self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            atexit.register(self.stop)

    def stop(self, clean: bool = True) -> None:
        """Stop the heartbeat. ``clean``: mark this rank done (it is never reported) and, on rank 0, wait
        (at most ``census_s``) for the others to be done or gone before the store goes away with us."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
        if self._prev_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_sigterm)
        if not clean or self._failed:
            return  # a failed rank is not "done": the others may still report it
        try:
            store = self._clone(timeout_s=self.census_s)
            store.set(self._hb(self.rank), _DONE)
            if self.rank == 0:
                deadline = time.monotonic() + self.census_s
                while time.monotonic() < deadline:
                    if all(v == _DONE for v in self._counters(store).values()):
                        break
                    time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store (rank 0) already left: nothing to hand over
            pass

    # -- heartbeat and monitor (thread) ------------------------------------------------------------

    def _counters(self, store) -> dict[int, bytes]:
        return dict(enumerate(store.multi_get([self._hb(r) for r in range(self.world_size)])))

    def _run(self) -> None:
        last_value: dict[int, bytes] = {}
        last_change: dict[int, float] = {}
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._store.add(self._hb(self.rank), 1)
                if self._store.check([f"{_PREFIX}/abort"]):
                    message = self._store.get(f"{_PREFIX}/abort").decode()
                    if self.rank != 0:
                        self._exit(None)  # rank 0 printed it
                    self._exit(message)
                counters = self._counters(self._store)
            except Exception:  # noqa: BLE001 - any store failure: its host, rank 0, is gone
                if self._stop.is_set() or self._rank0_done or self.rank == 0 or not _same_group(self._group):
                    return  # ... unless it finished, or this process tore the group down itself
                self._exit(self._gone_message([0], "the rendezvous store it hosts stopped answering"))
            now = time.monotonic()
            self._rank0_done = counters.get(0) == _DONE
            if self.rank != 0:
                continue
            for r, value in counters.items():
                if value != last_value.get(r):
                    last_value[r], last_change[r] = value, now
            stalled = [r for r, v in counters.items()
                       if v != _DONE and now - last_change[r] > self.peer_timeout_s]
            if stalled:
                message = self._gone_message(stalled, f"its heartbeat stood still for {self.peer_timeout_s:g} s")
                try:
                    self._store.set(f"{_PREFIX}/abort", message)
                    time.sleep(2 * self.heartbeat_s)  # let the others read it before the store goes
                except Exception:  # noqa: BLE001
                    pass
                self._exit(message)

    def _exit(self, message: str | None) -> None:
        if message and not self._reported:
            self._reported = True
            print(message, file=sys.stderr, flush=True)
        os._exit(PEER_GONE_EXIT_CODE)

    # -- census (main thread) ----------------------------------------------------------------------

    def census(self) -> list[int] | None:
        """Ranks whose heartbeat stands still for ``census_s`` (not counting ranks that finished).

        Returns None when the store itself is unreachable (then rank 0, its host, is gone).
        """
        try:
            store = self._clone(timeout_s=self.census_s)
            before = self._counters(store)
            deadline = time.monotonic() + self.census_s
            moved = {r for r, v in before.items() if v == _DONE}
            while time.monotonic() < deadline and len(moved) < self.world_size:
                time.sleep(min(0.2, self.heartbeat_s / 2))
                now = self._counters(store)
                moved |= {r for r in now if now[r] != before[r] or now[r] == _DONE}
            return sorted(set(range(self.world_size)) - moved)
        except Exception:  # noqa: BLE001
            return None

    def _describe(self, ranks: list[int]) -> list[str]:
        missing = [r for r in ranks if r not in self._infos]
        if missing:
            try:
                store = self._clone(timeout_s=2.0)
                for r, text in zip(missing, store.multi_get([f"{_PREFIX}/info/{r}" for r in missing]), strict=True):
                    self._infos[r] = RankInfo.decode(text.decode())
            except Exception:  # noqa: BLE001 - rank 0's store is gone: no details beyond the rank
                pass
        return [self._infos[r].describe() if r in self._infos else f"rank {r}" for r in ranks]

    def _gone_message(self, ranks: list[int], why: str) -> str:
        names = "; ".join(self._describe(ranks))
        verb = "is" if len(ranks) == 1 else "are"
        return (
            f"\nds_longseq watchdog: {names} of {self.world_size} {verb} gone: {why} (killed, crashed, out of "
            "memory or hung, or its launcher or node died). The job stops. The last checkpoint that every rank "
            "finished writing is intact: resume from it (examples/sft.py --resume)."
        )

    def _report_census(self, context: str) -> bool:
        """Run the census and print who is gone (lowest surviving rank only). True if someone is."""
        if self._reported:
            return True
        self._in_census = True
        try:
            gone = self.census()
        finally:
            self._in_census = False
        if gone is None:
            if self.rank == 0 or self._rank0_done:
                return False
            gone = [0]
            why = f"the rendezvous store it hosts stopped answering {context}"
        else:
            why = f"its heartbeat stood still for {self.census_s:g} s {context}"
        if not gone:
            return False
        survivors = [r for r in range(self.world_size) if r not in gone]
        if survivors and self.rank == survivors[0]:
            self._reported = True
            print(self._gone_message(gone, why), file=sys.stderr, flush=True)
        return True

    def _excepthook(self, exc_type, exc, tb) -> None:
        # The heartbeat goes on during the census: a rank failing because a peer died is not dead itself,
        # and the other survivors' censuses must see it move.
        self._failed = True
        if not issubclass(exc_type, KeyboardInterrupt):
            self._report_census(f"when rank {self.rank} failed with {exc_type.__name__}")
        (self._prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)

    def _on_sigterm(self, signum, frame) -> None:
        if self._in_census:
            return  # this rank is already on its way out: name the dead rank first (launch.py waits 30 s)
        self._report_census(f"when rank {self.rank} was sent SIGTERM")
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)


_ACTIVE: PeerWatch | None = None


def _same_group(group) -> bool:
    """Whether ``group`` is still this process's default process group (not destroyed or replaced)."""
    return group is not None and default_process_group() is group


def active_watch() -> PeerWatch | None:
    """The watch this process runs, if any."""
    return _ACTIVE


def start_watchdog(heartbeat_s: float = 1.0, peer_timeout_s: float = 120.0, census_s: float | None = None,
                   handle_exits: bool = True) -> PeerWatch | None:
    """Start the peer watchdog on every rank of the initialized default process group (collective).

    Returns the watch, the one already running, or None when there is nothing to watch (one rank, or
    a rendezvous store that cannot be cloned, e.g. a FileStore).
    """
    global _ACTIVE
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    if _ACTIVE is not None:
        if _same_group(_ACTIVE._group):
            return _ACTIVE
        _ACTIVE.stop(clean=False)  # the group it watched was destroyed: watch the new one
        _ACTIVE = None
    store = default_store()
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if not isinstance(base, dist.TCPStore) or not all(hasattr(base, m) for m in ("clone", "multi_get", "check")):
        return None  # a FileStore / HashStore, or a torch without TCPStore.clone: nothing to watch with
    rank, world = dist.get_rank(), dist.get_world_size()
    watch = PeerWatch(base, rank, world, heartbeat_s, peer_timeout_s, census_s)
    watch.register()
    dist.barrier()  # every rank's keys exist before anyone reads them
    if handle_exits and started_by_launcher():
        die_with_parent()
    watch.start(handle_exits=handle_exits)
    _ACTIVE = watch
    return watch
