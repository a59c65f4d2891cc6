"""The watched repository (``--model-control-mode poll``): filesystem events in, model rescans out.

Shape: a watchdog observer feeds every event to a :class:`ChangeTracker`; one worker thread waits until
a model's files have gone quiet and then starts ``rescan(names)``, on a thread of its own, with every
model that is due.  This is watchdog's ``EventDebouncer`` (each event resets a timer, one callback gets
the whole batch when things go quiet) with one timer per model, so a slow copy into one model never
holds back the others; and because each round runs on its own thread, a model whose load hangs in user
code (an ``initialize()`` that never returns) holds back only its own next round, never another model's.

What "settled" means, because a half-copied model must never load (Triton's issue #356):

* no event for the model for ``quiet_s`` seconds, and
* no file of the model is still open for writing: a file that was modified and not yet closed
  (inotify's ``IN_MODIFY`` without ``IN_CLOSE_WRITE``) holds the model back, however long the writer
  pauses between chunks, up to ``max_hold_s`` without events (a writer that died holding the file).

Then the lifecycle hashes the files, loads and warms the version up, and checks that no file changed
while it loaded.  A version that still fails (a writer that closes the file after every chunk) stays
UNAVAILABLE while the old one serves, and the next write to it triggers a new attempt: its content
hash differs from the one that failed.

Events for a model whose round is still running are kept in the tracker and handled by its next round,
once that one ended, so no change is lost and one model is never rescanned twice at once.  Hidden and
temporary files are ignored, except that renaming one into place counts
as a change of its destination (the recommended OTA procedure).  Opens and reads are not subscribed
to, so the server's own hashing and loading never wake the watcher.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import watchdog.events
from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

try:  # Linux; elsewhere watchdog's default observer is used as it is
    from watchdog.observers.inotify import InotifyEmitter, InotifyObserver
except Exception:  # noqa: BLE001 - watchdog raises its own error where inotify is missing
    InotifyObserver = None  # type: ignore[assignment,misc]
try:  # watchdog 7.1 and newer
    from watchdog.observers.inotify import InotifyWatchGroup  # type: ignore[attr-defined]  # not in 6
except Exception:  # noqa: BLE001
    InotifyWatchGroup = None  # type: ignore[assignment,misc]

from edge_server.errors import EdgeServerError
from edge_server.repository import is_ignored

log = logging.getLogger(__name__)

if hasattr(watchdog.events, "FileAttribEvent"):  # watchdog 7 and newer
    AttribEvent: type[FileSystemEvent] = watchdog.events.FileAttribEvent
else:

    class AttribEvent(FileModifiedEvent):  # type: ignore[no-redef]
        """A file's attributes changed (``chmod``, ``touch``): watchdog 7's FileAttribEvent.

        watchdog 6, the last release for Python 3.10 (JetPack 6's), reports it as a modification;
        ``_AttribEmitter`` tells the two apart, so that a touch does not hold its model as a write would.
        Its ``event_type`` stays "modified": watchdog 6 dispatches on it to handler methods it knows.
        """


# IN_OPEN and IN_CLOSE_NOWRITE are left out on purpose: our own reads must not look like changes.
WATCHED_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent,
    DirCreatedEvent,
    FileModifiedEvent,
    FileClosedEvent,
    FileDeletedEvent,
    DirDeletedEvent,
    FileMovedEvent,
    DirMovedEvent,
]
if not issubclass(AttribEvent, FileModifiedEvent):
    WATCHED_EVENTS.append(AttribEvent)


class ChangeTracker:
    """Which models changed and when they are settled enough to load; pure state, no threads.

    ``now`` is always passed in (``time.monotonic()`` in production) so the rules can be tested without
    waiting.
    """

    def __init__(self, *roots: str | Path, quiet_s: float, max_hold_s: float) -> None:
        """``roots``: the repositories watched; no one lies inside another (see Repositories)."""
        self._roots = [os.path.abspath(root) for root in roots]
        self._quiet = quiet_s
        self._max_hold = max_hold_s
        self._pending: dict[str, float] = {}  # model -> time of its last event
        self._writing: dict[str, str] = {}  # path still open for writing -> its model

    def model_of(self, path: str | bytes) -> str | None:
        """The model a path belongs to, or None for a root itself, outside paths and ignored files.

        Names are unique across repositories (a name in two is refused when it is rescanned), so a
        model is known by its name wherever its files lie.
        """
        text = os.fsdecode(path)
        if not text:
            return None
        full = os.path.abspath(text)
        for root in self._roots:
            parts = Path(os.path.relpath(full, root)).parts
            if not parts or parts[0] in (".", ".."):
                continue
            return None if any(is_ignored(part) for part in parts) else parts[0]
        return None

    def observe(self, event: FileSystemEvent, now: float) -> bool:
        """Take one event; True if it concerned a model."""
        src = os.fsdecode(event.src_path)
        dest = os.fsdecode(event.dest_path) if event.dest_path else ""
        if isinstance(event, AttribEvent):
            pass  # a touch or chmod: a change to look at, not a file being written
        elif isinstance(event, FileModifiedEvent):
            model = self.model_of(src)
            if model is not None:
                self._writing[os.path.abspath(src)] = model
        elif isinstance(event, (FileClosedEvent, FileDeletedEvent)):
            self._writing.pop(os.path.abspath(src), None)
        elif isinstance(event, (DirDeletedEvent, DirMovedEvent)):
            prefix = os.path.abspath(src) + os.sep
            for path in [p for p in self._writing if p.startswith(prefix)]:
                del self._writing[path]
        elif isinstance(event, FileMovedEvent):
            model = self._writing.pop(os.path.abspath(src), None)
            dest_model = self.model_of(dest)
            if model is not None and dest_model is not None:
                self._writing[os.path.abspath(dest)] = dest_model
        touched = {m for m in (self.model_of(src), self.model_of(dest)) if m is not None}
        for model in touched:
            self._pending[model] = now
        return bool(touched)

    def take_due(self, now: float, busy: Collection[str] = ()) -> list[str]:
        """The models that have settled, removed from the pending set; ``busy`` ones stay pending."""
        due = []
        for model, last_event in self._pending.items():
            if model in busy:
                continue
            quiet_for = now - last_event
            if quiet_for < self._quiet:
                continue
            writers = [p for p, m in self._writing.items() if m == model]
            if writers and quiet_for < self._max_hold:
                continue
            if writers:
                log.warning(
                    "model %s: %s still open for writing after %.0f s without events; loading anyway",
                    model,
                    ", ".join(writers),
                    quiet_for,
                )
                for path in writers:
                    del self._writing[path]
            due.append(model)
        for model in due:
            del self._pending[model]
        return sorted(due)

    def next_check(self, now: float, busy: Collection[str] = ()) -> float | None:
        """Seconds until :meth:`take_due` may return something new, or None while nothing is pending.

        ``busy`` models do not count: they wait for their round to end, which wakes the watcher.
        """
        held = set(self._writing.values())
        waits = [
            last_event + (self._max_hold if model in held else self._quiet) - now
            for model, last_event in self._pending.items()
            if model not in busy
        ]
        return max(0.0, min(waits)) if waits else None

    def pending(self) -> list[str]:
        return sorted(self._pending)


if (
    InotifyObserver is not None
    and InotifyWatchGroup is not None
    and hasattr(InotifyWatchGroup, "_remove_watch_internally")
):

    class _TolerantWatchGroup(InotifyWatchGroup):
        """Watch bookkeeping that survives directories renamed out of the tree.

        watchdog 7.1 keeps the watch of a directory renamed out of the tree under its old path.  When a
        new directory of that name is then watched and deleted, removing the old watch raises KeyError in
        watchdog's inotify thread, which dies: the watcher goes deaf without a word, and stopping it
        raises.  An OTA rollback (``mv models/m/4 /backup``, a new ``4`` later, ``rm -r /backup``) does
        exactly this, so forget such stale watches quietly instead.
        """

        def _remove_watch_internally(self, wd: Any) -> None:
            path = self._active_callbacks_by_watch.pop(wd, None)
            if path is not None and self._active_callbacks_by_path.get(path) == wd:
                del self._active_callbacks_by_path[path]

    class _TolerantEmitter(InotifyEmitter):
        def on_thread_start(self) -> None:
            self._inotify = _TolerantWatchGroup(
                self._inotify_fd,  # type: ignore[attr-defined]  # watchdog >= 7.1, as this class
                os.fsencode(self.watch.path),
                is_recursive=self.watch.is_recursive,
                event_mask=self.get_event_mask_from_filter(),
                follow_symlink=self.watch.follow_symlink,  # type: ignore[attr-defined]
            )

    _EMITTER: type[InotifyEmitter] | None = _TolerantEmitter

elif InotifyObserver is not None and issubclass(AttribEvent, FileModifiedEvent):

    class _AttribEmitter(InotifyEmitter):
        """watchdog 6's emitter, reporting a change of attributes as an AttribEvent.

        watchdog 6 turns inotify's IN_ATTRIB and IN_MODIFY into the same FileModifiedEvent, one raw
        event at a time on this emitter's thread: the raw event it last read says which it was.
        """

        _attrib_only = False

        def on_thread_start(self) -> None:
            super().on_thread_start()
            buffer = self._inotify
            read = buffer.read_event  # type: ignore[union-attr]

            def read_event() -> Any:
                event = read()
                self._attrib_only = bool(
                    event is not None
                    and not isinstance(event, tuple)
                    and event.is_attrib
                    and not event.is_modify
                )
                return event

            buffer.read_event = read_event  # type: ignore[union-attr,method-assign]

        def queue_event(self, event: FileSystemEvent) -> None:
            if self._attrib_only and type(event) is FileModifiedEvent:
                event = AttribEvent(event.src_path)
            super().queue_event(event)

    _EMITTER = _AttribEmitter

else:
    _EMITTER = None


def _observer() -> BaseObserver:
    """The observer: on inotify, with the emitter above that mends the installed watchdog."""
    if _EMITTER is None or Observer is not InotifyObserver:
        return Observer()
    observer = InotifyObserver()
    observer._emitter_class = _EMITTER  # what watchdog's own subclasses set: the emitter per watch
    return observer


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: RepositoryWatcher) -> None:
        self._watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._watcher.observe(event)


class RepositoryWatcher:
    """Watches repositories with inotify (via watchdog) and calls ``rescan(names)`` when models settle.

    Each ``rescan`` round runs on a thread of its own, and a model is in at most one round at a time;
    exceptions are logged and the watcher goes on, so a failed or hung load never stops it from
    picking up the next drop of another model.
    """

    def __init__(
        self,
        roots: Sequence[str | Path],
        rescan: Callable[[list[str]], None],
        *,
        quiet_s: float = 0.5,
        max_hold_s: float = 30.0,
    ) -> None:
        """``roots``: every repository of the server, each watched (recursively) by one observer."""
        self.roots = [Path(root) for root in roots]
        self._rescan = rescan
        self._tracker = ChangeTracker(*self.roots, quiet_s=quiet_s, max_hold_s=max_hold_s)
        self._cond = threading.Condition()
        self._stopping = False
        self._running: set[str] = set()  # models whose round is running
        self._round_threads: set[threading.Thread] = set()
        self._rounds: dict[str, int] = {}
        self._observer: BaseObserver | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching; events from now on are acted upon."""
        observer = _observer()
        observer.daemon = True
        handler = _Handler(self)
        watching = ""
        try:
            for root in self.roots:
                watching = str(root)
                observer.schedule(handler, watching, recursive=True, event_filter=WATCHED_EVENTS)
            watching = ", ".join(map(str, self.roots))
            observer.start()
        except OSError as exc:  # ENOSPC: out of inotify watches; EMFILE: out of inotify instances
            observer.stop()
            raise EdgeServerError(
                f"cannot watch {watching} for changes: {exc}; raise fs.inotify.max_user_watches "
                "and fs.inotify.max_user_instances, or use --model-control-mode explicit"
            ) from exc
        self._observer = observer
        self._thread = threading.Thread(target=self._run, name="edge-repository-watcher", daemon=True)
        self._thread.start()
        log.info("watching %s for model changes", ", ".join(map(str, self.roots)))

    def stop(self, deadline: float | None = None) -> bool:
        """Stop watching; pending changes are dropped and no new rescan starts.

        Waits for a rescan in progress until ``deadline`` (monotonic; None: as long as it takes) and
        returns whether it ended.  A rescan may be loading a model whose ``initialize()`` takes minutes:
        a stop must not wait for it past the daemon's one shutdown budget, so the server passes its
        deadline, has the manager abandon the load, and calls ``stop`` again to wait for what is left.
        """
        observer, self._observer = self._observer, None
        if observer is not None:
            try:
                observer.stop()
            except Exception:  # a watchdog bug must not stop the server from shutting down
                log.exception("stopping the repository observer failed")
            observer.join()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        with self._cond:
            rounds = list(self._round_threads)
        # The rescan thread, then any round in progress (the lifecycle abandons a hung load).
        for waited in ([thread] if thread is not None else []) + rounds:
            waited.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if waited.is_alive():
                return False
        self._thread = None
        return True

    def observe(self, event: FileSystemEvent) -> None:
        """Feed one event (the observer thread calls this; tests may too)."""
        with self._cond:
            if self._tracker.observe(event, time.monotonic()):
                log.debug("repository event %s", event)
                self._cond.notify_all()

    def rounds(self, name: str) -> int:
        """How many rescans of ``name`` have finished; lets callers wait for a change to be handled."""
        with self._cond:
            return self._rounds.get(name, 0)

    def idle(self) -> bool:
        """True when no change is pending and no rescan is running."""
        with self._cond:
            return not self._running and not self._tracker.pending()

    def _run(self) -> None:
        while True:
            with self._cond:
                due: list[str] = []
                while not self._stopping:
                    now = time.monotonic()
                    due = self._tracker.take_due(now, self._running)
                    if due:
                        break
                    self._cond.wait(self._tracker.next_check(now, self._running))
                if self._stopping:
                    return
                self._running.update(due)
                thread = threading.Thread(
                    target=self._round, args=(due,), name="edge-repository-rescan", daemon=True
                )
                self._round_threads.add(thread)
            thread.start()

    def _round(self, due: list[str]) -> None:
        """One rescan of ``due``, beside the rounds of other models (see the class doc)."""
        log.info("repository changed: rescanning %s", ", ".join(due))
        try:
            self._rescan(due)
        except Exception:  # the watcher never dies: the next change is picked up all the same
            log.exception("rescan of %s failed", ", ".join(due))
        with self._cond:
            self._running.difference_update(due)
            self._round_threads.discard(threading.current_thread())
            for name in due:
                self._rounds[name] = self._rounds.get(name, 0) + 1
            self._cond.notify_all()
