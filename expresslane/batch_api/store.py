"""The durable queue behind the Batch API: one small interface, two stores.

A store holds files, batches, each request's state and each request's result. Work is
handed out with a lease (a claimer takes over requests whose owner has not claimed or
renewed them for the claimer's lease: servers sharing a store use the same lease)::

    queued --claim(lease)--> claimed --complete(result)--> done
       ^                        |
       +---- lease expires -----+      (the worker died: kill -9, crash, restart)

``complete`` writes a request's result at most once, keyed by (batch, custom_id): a
request that ran twice (its first worker died after running it) is answered once.
Counts move in the same transaction as the result, so ``request_counts`` never
disagrees with the results. ``finalize_due`` turns batches whose requests are all
answered (or that were cancelled or expired) into their output and error files, in one
transaction that only one caller wins; anyone may call it, at any time.

``open_store("sqlite:PATH")`` or ``open_store("redis://HOST:PORT/DB")`` (registry.py) picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from expresslane.batch_api.records import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    MAX_FILE_BYTES,
    BatchRecord,
    FileRecord,
    Item,
    ItemResult,
    new_id,
    output_files,
    parse_input,
)


class StoreError(ValueError):
    """Bad input to the store: ``status`` 400 or 404, ``param`` the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class BatchStore(ABC):
    # -- files --------------------------------------------------------------------------------
    @abstractmethod
    def put_file(self, rec: FileRecord, content: bytes) -> None: ...

    @abstractmethod
    def get_file(self, file_id: str) -> FileRecord | None: ...

    @abstractmethod
    def file_content(self, file_id: str) -> bytes | None: ...

    @abstractmethod
    def list_files(self, purpose: str | None, after: str | None, limit: int) -> list[FileRecord]:
        """Newest first; ``after``: the id of the last file of the previous page."""

    @abstractmethod
    def delete_file(self, file_id: str) -> bool: ...

    # -- batches ------------------------------------------------------------------------------
    @abstractmethod
    def add_batch(self, batch: BatchRecord, items: list[Item]) -> None:
        """The batch and its queued requests, atomically."""

    @abstractmethod
    def get_batch(self, batch_id: str) -> BatchRecord | None: ...

    @abstractmethod
    def list_batches(self, after: str | None, limit: int) -> list[BatchRecord]:
        """Newest first; ``after``: the id of the last batch of the previous page."""

    @abstractmethod
    def open_batches(self) -> list[BatchRecord]:
        """Batches still in progress or cancelling."""

    @abstractmethod
    def set_cancelling(self, batch_id: str, now: int) -> BatchRecord | None:
        """in_progress -> cancelling (no request of it is claimed again); None: unknown batch."""

    @abstractmethod
    def _finish(self, batch: BatchRecord, from_status: str, files: list[tuple[FileRecord, bytes]]) -> bool:
        """Write ``files`` and ``batch`` (its new status) if the batch is still in ``from_status``; atomic."""

    # -- the queue ----------------------------------------------------------------------------
    @abstractmethod
    def claim(self, worker: str, n: int, lease: float, now: float) -> list[Item]:
        """Up to n unanswered requests of in-progress batches that nobody holds (or whose owner has not
        touched them for ``lease`` seconds), now held by ``worker``."""

    @abstractmethod
    def renew(self, worker: str, items: list[Item], lease: float, now: float) -> None:
        """Extend the leases of requests still running."""

    @abstractmethod
    def release(self, worker: str, items: list[Item]) -> None:
        """Give claimed requests back unanswered (the server is busy or stopping)."""

    @abstractmethod
    def complete(self, item: Item, result: ItemResult) -> bool:
        """Write the request's result unless it has one; True when this call wrote it."""

    @abstractmethod
    def results(self, batch_id: str) -> list[ItemResult]: ...

    def close(self) -> None:
        pass

    # -- shared logic -------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None,
                     now: int) -> BatchRecord:
        """Validate the input file and queue its requests; a file with bad lines gives a ``failed`` batch."""
        if endpoint not in ENDPOINTS:
            raise StoreError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise StoreError(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, "
                             f"got {completion_window!r}", "completion_window")
        f = self.get_file(input_file_id)
        if f is None:
            raise StoreError(f"no file with id {input_file_id!r}", "input_file_id", 404, "not_found")
        if f.purpose != "batch":
            raise StoreError(f"file {input_file_id!r} has purpose {f.purpose!r}, not 'batch'", "input_file_id")
        items, errors = parse_input(self.file_content(input_file_id) or b"", endpoint)
        batch = BatchRecord(new_id("batch_"), endpoint, input_file_id, completion_window, now,
                            now + COMPLETION_WINDOWS[completion_window], "in_progress", metadata=metadata)
        if errors:
            batch.status, batch.errors, batch.failed_at = "failed", errors, now
            items = []
        else:
            batch.total, batch.in_progress_at = len(items), now
            models = {i.body.get("model") for i in items}
            batch.model = models.pop() if len(models) == 1 else None
            for i in items:
                i.batch_id = batch.id
        self.add_batch(batch, items)
        return batch

    def cancel(self, batch_id: str, now: int) -> BatchRecord:
        b = self.set_cancelling(batch_id, now)
        if b is None:
            raise StoreError(f"no batch with id {batch_id!r}", "batch_id", 404, "not_found")
        return b

    def finalize_due(self, now: int, lease: float) -> list[str]:
        """Finish every batch that is done, cancelled (its last leases run out) or expired; their ids."""
        done = []
        for b in self.open_batches():
            if b.status == "cancelling" and now >= b.cancelling_at + lease:
                final = "cancelled"
            elif b.status == "in_progress" and b.completed + b.failed >= b.total:
                final = "completed"
            elif b.status == "in_progress" and now >= b.expires_at:
                final = "expired"
            else:
                continue
            if self._finalize(b, final, now):
                done.append(b.id)
        return done

    def _finalize(self, b: BatchRecord, final: str, now: int) -> bool:
        from_status = b.status
        results = self.results(b.id)
        if final == "expired":  # the requests that never ran are errors of the batch
            answered = {r.custom_id for r in results}
            items, _ = parse_input(self.file_content(b.input_file_id) or b"", b.endpoint)
            results += [ItemResult(i.custom_id, i.index, None, error={
                "code": "batch_expired", "message": "this request could not be run before the batch expired"})
                for i in items if i.custom_id not in answered]
        out, err, b.usage = output_files(results)
        # The counts are those of the files (a result that lands after this read is refused).
        b.completed = sum(r.ok for r in results)
        b.failed = len(results) - b.completed
        files = []
        for suffix, content, attr in (("output", out, "output_file_id"), ("errors", err, "error_file_id")):
            if content:
                rec = FileRecord(f"file-{b.id}-{suffix}", len(content), now, f"{b.id}_{suffix}.jsonl",
                                 "batch_output")
                files.append((rec, content))
                setattr(b, attr, rec.id)
        b.status, b.finalizing_at = final, now
        b.completed_at = now if final == "completed" else None
        b.cancelled_at = now if final == "cancelled" else None
        b.expired_at = now if final == "expired" else None
        return self._finish(b, from_status, files)


def check_upload(content: bytes, purpose: str) -> None:
    if purpose != "batch":
        raise StoreError(f"purpose must be 'batch' (the only purpose this server stores), got {purpose!r}", "purpose")
    if len(content) > MAX_FILE_BYTES:
        raise StoreError(f"a batch input file may hold at most {MAX_FILE_BYTES} bytes, got {len(content)}", "file")
