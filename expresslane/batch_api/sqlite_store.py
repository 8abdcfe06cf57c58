"""The embedded store: one SQLite file (stdlib ``sqlite3``, WAL journal).

A claimed request's ``touched`` is when its owner last claimed or renewed it; a claimer
takes over requests untouched for its lease (as Redis's ``XAUTOCLAIM`` does with idle
time). Every change is one ``BEGIN IMMEDIATE`` transaction, so several processes may share
the file (SQLite serialises writers); a process killed mid-transaction leaves nothing
half-written. A result and its batch's count move together (``complete``).
"""

from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

from expresslane.batch_api.records import BatchRecord, FileRecord, Item, ItemResult
from expresslane.batch_api.store import BatchStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, meta TEXT NOT NULL, content BLOB NOT NULL,
                                  purpose TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, record TEXT NOT NULL, status TEXT NOT NULL,
                                    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS items (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, request TEXT NOT NULL,
                                  done INTEGER NOT NULL DEFAULT 0, owner TEXT, touched REAL NOT NULL DEFAULT 0,
                                  PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS items_todo ON items (done, touched);
CREATE TABLE IF NOT EXISTS results (batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, result TEXT NOT NULL,
                                    PRIMARY KEY (batch_id, custom_id));
"""
_OPEN = ("in_progress", "cancelling")


class SQLiteStore(BatchStore):
    def __init__(self, path: str):
        if not path:
            raise ValueError("the SQLite batch store needs a file path (sqlite:PATH)")
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we write BEGIN/COMMIT ourselves. One connection, used under a lock
        # (the server calls the store from worker threads).
        self._db = sqlite3.connect(Path(path).expanduser(), timeout=60, isolation_level=None,
                                   check_same_thread=False)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # with WAL: a committed write survives a process crash
        self._db.executescript(_SCHEMA)  # its own transaction

    @contextmanager
    def _tx(self, write: bool = True):
        with self._lock:
            if not write:
                yield self._db
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- files --------------------------------------------------------------------------------
    def put_file(self, rec: FileRecord, content: bytes) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
                       (rec.id, rec.to_json(), content, rec.purpose))

    def get_file(self, file_id: str) -> FileRecord | None:
        with self._tx(write=False) as db:
            row = db.execute("SELECT meta FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else FileRecord.from_json(row[0])

    def file_content(self, file_id: str) -> bytes | None:
        with self._tx(write=False) as db:
            row = db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def list_files(self, purpose: str | None, after: str | None, limit: int) -> list[FileRecord]:
        q, args = "SELECT meta FROM files WHERE 1", []
        if purpose is not None:
            q += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            q += " AND rowid < (SELECT rowid FROM files WHERE id = ?)"
            args.append(after)
        with self._tx(write=False) as db:
            rows = db.execute(q + " ORDER BY rowid DESC LIMIT ?", (*args, limit)).fetchall()
        return [FileRecord.from_json(r[0]) for r in rows]

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 1

    # -- batches ------------------------------------------------------------------------------
    def add_batch(self, batch: BatchRecord, items: list[Item]) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, record, status) VALUES (?, ?, ?)",
                       (batch.id, batch.to_json(), batch.status))
            db.executemany("INSERT INTO items (batch_id, idx, request) VALUES (?, ?, ?)",
                           ((batch.id, i.index, i.to_json()) for i in items))

    @staticmethod
    def _batch(row) -> BatchRecord:
        b = BatchRecord.from_json(row[0])
        b.status, b.completed, b.failed = row[1], row[2], row[3]
        return b

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        with self._tx(write=False) as db:
            row = db.execute("SELECT record, status, completed, failed FROM batches WHERE id = ?",
                             (batch_id,)).fetchone()
        return None if row is None else self._batch(row)

    def list_batches(self, after: str | None, limit: int) -> list[BatchRecord]:
        q, args = "SELECT record, status, completed, failed FROM batches", []
        if after is not None:
            q += " WHERE rowid < (SELECT rowid FROM batches WHERE id = ?)"
            args.append(after)
        with self._tx(write=False) as db:
            rows = db.execute(q + " ORDER BY rowid DESC LIMIT ?", (*args, limit)).fetchall()
        return [self._batch(r) for r in rows]

    def open_batches(self) -> list[BatchRecord]:
        with self._tx(write=False) as db:
            rows = db.execute("SELECT record, status, completed, failed FROM batches WHERE status IN (?, ?)",
                              _OPEN).fetchall()
        return [self._batch(r) for r in rows]

    def set_cancelling(self, batch_id: str, now: int) -> BatchRecord | None:
        with self._tx() as db:
            row = db.execute("SELECT record, status, completed, failed FROM batches WHERE id = ?",
                             (batch_id,)).fetchone()
            if row is None:
                return None
            b = self._batch(row)
            if b.status == "in_progress":
                b.status, b.cancelling_at = "cancelling", now
                db.execute("UPDATE batches SET record = ?, status = ? WHERE id = ?", (b.to_json(), b.status, b.id))
        return b

    def _finish(self, batch: BatchRecord, from_status: str, files: list[tuple[FileRecord, bytes]]) -> bool:
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch.id,)).fetchone()
            if row is None or row[0] != from_status:
                return False
            for rec, content in files:
                db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
                           (rec.id, rec.to_json(), content, rec.purpose))
            db.execute("UPDATE batches SET record = ?, status = ?, completed = ?, failed = ? WHERE id = ?",
                       (batch.to_json(), batch.status, batch.completed, batch.failed, batch.id))
        return True

    # -- the queue ----------------------------------------------------------------------------
    def claim(self, worker: str, n: int, lease: float, now: float) -> list[Item]:
        if n <= 0:
            return []
        with self._tx() as db:
            rows = db.execute(
                "SELECT i.batch_id, i.idx, i.request FROM items i JOIN batches b ON b.id = i.batch_id "
                "WHERE i.done = 0 AND i.touched <= ? AND b.status = 'in_progress' LIMIT ?", (now - lease, n)).fetchall()
            db.executemany("UPDATE items SET owner = ?, touched = ? WHERE batch_id = ? AND idx = ?",
                           ((worker, now, r[0], r[1]) for r in rows))
        return [Item.from_json(r[0], r[1], r[2]) for r in rows]

    def renew(self, worker: str, items: list[Item], lease: float, now: float) -> None:
        with self._tx() as db:
            db.executemany("UPDATE items SET touched = ? WHERE batch_id = ? AND idx = ? AND owner = ? AND done = 0",
                           ((now, i.batch_id, i.index, worker) for i in items))

    def release(self, worker: str, items: list[Item]) -> None:
        with self._tx() as db:
            db.executemany("UPDATE items SET touched = 0, owner = NULL "
                           "WHERE batch_id = ? AND idx = ? AND owner = ? AND done = 0",
                           ((i.batch_id, i.index, worker) for i in items))

    def complete(self, item: Item, result: ItemResult) -> bool:
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (item.batch_id,)).fetchone()
            if row is None or row[0] not in _OPEN:
                return False  # finished (cancelled, expired) without this request
            wrote = db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?)",
                               (item.batch_id, item.custom_id, result.to_json())).rowcount == 1
            if wrote:
                db.execute("UPDATE items SET done = 1 WHERE batch_id = ? AND idx = ?", (item.batch_id, item.index))
                column = "completed" if result.ok else "failed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (item.batch_id,))
        return wrote

    def results(self, batch_id: str) -> list[ItemResult]:
        with self._tx(write=False) as db:
            rows = db.execute("SELECT result FROM results WHERE batch_id = ?", (batch_id,)).fetchall()
        return [ItemResult.from_json(r[0]) for r in rows]
