"""The engine process's incoming messages, with large ones admitted a few per step.

Decoding and admitting one Add of 256 prompts × 2,047 token ids takes tens of milliseconds;
handled between two steps, it stretched every other stream's gap by that much. So the API
process sends such a request as several Add messages (``wire.add_messages``) and the engine
takes a frame over ``BULK_FRAME_BYTES`` as bulk work: it waits until the other messages that
arrived with it are handled, and each step admits bulk frames up to ``BULK_BYTES_PER_STEP``.
A new short request is thus admitted at once, ahead of the rest of a large one.

Handling a frame after a later one is safe for every message but an ``Abort`` that overtakes
the ``Add`` of its request: while bulk frames wait, aborted ids are remembered and those
requests are dropped when their frame comes (``dropped``).
"""

from __future__ import annotations

import collections
from typing import Callable, Iterator

BULK_FRAME_BYTES = 64 * 1024  # a frame larger than this is bulk work (some 20,000 prompt tokens)
BULK_BYTES_PER_STEP = 256 * 1024  # bulk frames admitted between two steps, at most (at least one)


class Inbox:
    def __init__(self, decode: Callable[[bytes], object], bulk_frame_bytes: int = BULK_FRAME_BYTES,
                 bulk_bytes_per_step: int = BULK_BYTES_PER_STEP):
        self._decode = decode
        self._bulk_frame_bytes = bulk_frame_bytes
        self._bulk_bytes_per_step = bulk_bytes_per_step
        self._small: collections.deque[bytes] = collections.deque()
        self._bulk: collections.deque[bytes] = collections.deque()
        self._aborted: set[str] = set()  # aborted while bulk frames waited: their Add may be among them

    def put(self, frame: bytes) -> None:
        (self._bulk if len(frame) > self._bulk_frame_bytes else self._small).append(frame)

    @property
    def has_bulk(self) -> bool:
        return bool(self._bulk)

    def messages(self) -> Iterator[object]:
        """This step's messages, decoded: every small one in arrival order, then bulk ones up to the budget."""
        while self._small:
            yield self._decode(self._small.popleft())
        spent = 0
        while self._bulk and spent < self._bulk_bytes_per_step:
            frame = self._bulk.popleft()
            spent += len(frame)
            yield self._decode(frame)
        if not self._bulk:  # every Add sent before those aborts has been seen
            self._aborted.clear()

    def aborted(self, request_ids: list[str]) -> None:
        if self._bulk:
            self._aborted.update(request_ids)

    def dropped(self, request_id: str) -> bool:
        """Whether this request was aborted before its (bulk) Add was handled."""
        return request_id in self._aborted
