"""Producing elements ahead on a background thread (``prefetch``).

    >>> from mpistrat.data.threads import prefetched
    >>> list(prefetched(iter(range(5)), depth=2))
    [0, 1, 2, 3, 4]

The producer stops when the consumer goes away (the generator is closed or
collected); an error in the producer is raised in the consumer, in order.
"""

import queue
import threading
from typing import Any, Iterator

__all__ = ["prefetched"]

_DONE = object()


def prefetched(elements: Iterator[Any], depth: int) -> Iterator[Any]:
    """``elements`` produced by a thread that keeps up to ``depth`` of them ready."""
    buffer: "queue.Queue" = queue.Queue(maxsize=max(int(depth), 1))
    stop = threading.Event()

    def produce():
        try:
            for element in elements:
                while not stop.is_set():
                    try:
                        buffer.put(element, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            buffer.put(_DONE)
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
            buffer.put(err)

    thread = threading.Thread(target=produce, daemon=True, name="mpistrat-prefetch")
    started = False
    try:
        thread.start()
        started = True
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        if started:
            _drain(buffer)


def _drain(buffer: "queue.Queue") -> None:
    """Free a producer blocked on a full queue, so it sees ``stop`` and ends."""
    try:
        while True:
            buffer.get_nowait()
    except queue.Empty:
        pass
