"""Several configurations' searches at once, each in a forked process (estimate mode).

An estimate trial is Python bound to one core (fake tensors, no arithmetic), so the searches
of different levels run side by side in child processes forked from this one: they inherit
the workload, and any model already built and warmed up (:func:`actune.tune.probe.warm_up`),
without pickling either. Each child sends its trials (for the progress bar) and its row back
through a queue; rows are yielded as they finish. Ctrl-C in the parent interrupts every
running search once, and each sends back its best answer so far, as a search in this process
does. Off Linux (no ``fork`` on Windows; on macOS it is unsafe once system frameworks run
threads) the searches run here, one after another, as they do on one core.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue as queues
import signal
import sys
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from actune import tunables

__all__ = ["available_workers", "run_searches"]


def available_workers() -> int:
    """Cores this process may run on (its CPU affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def can_fork() -> bool:
    """Linux only: elsewhere ``fork`` is missing (Windows) or unsafe once system frameworks
    have started threads (macOS), so the searches run one after another."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def run_searches(items: Sequence, search: Callable, on_probe: Callable | None,
                 workers: int, cost: Callable | None = None) -> Iterator[tuple[int, object]]:
    """``search(item, on_probe)`` for each item, yielding ``(index, result)`` as each ends:
    in this process when ``workers`` is 1 (or ``fork`` is unavailable), else in up to
    ``workers`` forked processes at once, started costliest first (``cost(item)``: a guess
    at the relative time, so that the longest search does not start last). An error in a
    search is raised here."""
    if workers <= 1 or len(items) <= 1 or not can_fork():
        for i, item in enumerate(items):
            yield i, search(item, on_probe)
        return
    order = sorted(range(len(items)), key=lambda i: -cost(items[i])) if cost else None
    yield from _forked(items, search, on_probe, workers, order or list(range(len(items))))


def _forked(items: Sequence, search: Callable, on_probe: Callable | None,
            workers: int, order: list[int]) -> Iterator[tuple[int, object]]:
    ctx = multiprocessing.get_context("fork")
    messages = ctx.Queue()
    pending = deque(order)
    running: dict[int, multiprocessing.process.BaseProcess] = {}
    ended: set[int] = set()  # children found ended at the last poll that got nothing
    interrupted = False
    try:
        while pending or running:
            while pending and len(running) < workers and not interrupted:
                i = pending.popleft()
                running[i] = _start(ctx.Process(target=_child, daemon=True,
                                                args=(messages, i, items[i], search)))
            try:
                kind, i, payload = messages.get(timeout=tunables.POLL_SECONDS)
                if kind == "probe":
                    if on_probe is not None:
                        on_probe(items[i], payload)
                    continue
            except queues.Empty:
                ended = _given_up(running, ended, items, interrupted)
                continue
            except KeyboardInterrupt:
                if interrupted:  # a second Ctrl-C: stop waiting for the children
                    raise
                interrupted = True
                pending.clear()
                for child in running.values():
                    _interrupt(child)
                continue
            ended.discard(i)
            running.pop(i).join()
            if kind == "error":
                raise payload
            if kind == "row":
                yield i, payload
        if interrupted:
            raise KeyboardInterrupt
    finally:
        for child in running.values():
            child.terminate()
            child.join()
        messages.close()


def _given_up(running: dict, ended: set[int], items: Sequence, interrupted: bool) -> set[int]:
    """After a poll that got nothing: drop the children that had already ended at the
    previous one (their last message is not coming) and return those ended now. Unless
    interrupted, a child that ended without its row is an error."""
    for i in [i for i in ended if i in running]:
        code = running.pop(i).exitcode
        if not interrupted:
            raise RuntimeError(_lost(items[i], code))
    now = set()
    for i, child in running.items():
        if not child.is_alive():
            if child.exitcode and not interrupted:  # killed or crashed: no need to wait
                raise RuntimeError(_lost(items[i], child.exitcode))
            now.add(i)
    return now


def _lost(item, code: int | None) -> str:
    return (f"the search of {getattr(item, 'name', item)} ended without a result (its "
            f"process exited with code {code}); run it alone with --jobs 1")


_SIGNALS = {signal.SIGINT, signal.SIGUSR1}


def _start(child):
    """Start ``child`` with Ctrl-C and the parent's interrupt held back until it has set up
    its handlers (a signal in between would kill it)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        child.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return child


def _interrupt(child) -> None:
    with contextlib.suppress(ProcessLookupError, TypeError):  # it may have just ended
        os.kill(child.pid, signal.SIGUSR1)


def _child(messages, i: int, item, search: Callable) -> None:  # runs in the forked process
    # Ctrl-C reaches the parent, which passes it on once (SIGUSR1): a search interrupted
    # twice could lose the answer it was returning
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.default_int_handler)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        torch.set_num_threads(1)  # fake tensors: nothing to compute in parallel
        result = search(item, lambda _item, probe: _send(messages, ("probe", i, probe)))
        _send(messages, ("row", i, result))
    except KeyboardInterrupt:  # before the search had anything to keep
        _send(messages, ("interrupted", i, None))
    except BaseException as err:  # sent back whole: the parent raises it
        _send(messages, ("error", i, _portable(err)))
    finally:  # its message is sent: an interrupt now would only cut the sending short
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        messages.close()
        messages.join_thread()


def _send(messages, message: tuple) -> None:
    """Put ``message`` with the interrupt held back: landing inside ``put`` (while it starts
    the queue's feeder thread) it left a queue that never sent anything again."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        messages.put(message)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _portable(err: BaseException) -> BaseException:
    """``err`` with the child's traceback as a note, or a RuntimeError naming it if it does
    not pickle."""
    err.add_note("in the search's process:\n" + "".join(traceback.format_exception(err)))
    try:
        pickle.dumps(err)
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err
