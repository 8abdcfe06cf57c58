"""The shared store: Redis, for several servers draining one queue.

Requests wait in one stream (``PREFIX:queue``) read by one consumer group; each server
is a consumer. A claimed request is a pending entry of its consumer; a lease is the
entry's idle time: renewing resets it (``XCLAIM`` by the owner), and entries idle for
longer than the lease (their server died) are taken over with ``XAUTOCLAIM``. Results,
counts and acknowledgements change together in Lua scripts (atomic in Redis)::

    PREFIX:file:ID        hash meta, content          PREFIX:files    zset of file ids (by seq)
    PREFIX:batch:ID       hash record, status, completed, failed
    PREFIX:batches        zset of batch ids (by seq)  PREFIX:open     set of unfinished batch ids
    PREFIX:items:BATCH    hash index -> request       PREFIX:results:BATCH  hash custom_id -> result

Leases are measured by the Redis server's clock, so the ``now`` arguments are unused.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from expresslane.batch_api.records import BatchRecord, FileRecord, Item, ItemResult
from expresslane.batch_api.store import BatchStore

GROUP = "workers"

# KEYS: batch, results, queue; ARGV: custom_id, result, count field, group, entry id
_COMPLETE = """
redis.call('XACK', KEYS[3], ARGV[4], ARGV[5])
redis.call('XDEL', KEYS[3], ARGV[5])
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'in_progress' and st ~= 'cancelling' then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
  return 1
end
return 0
"""
# KEYS: queue; ARGV: group, consumer, min idle ms (0), entry ids... -> only entries still ours
_RENEW = """
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[i], 'JUSTID')
  end
end
return 0
"""
# KEYS: queue; ARGV: group, consumer, then (entry id, batch, index) triples: requeue entries still ours
_RELEASE = """
for i = 3, #ARGV, 3 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
    redis.call('XADD', KEYS[1], '*', 'batch', ARGV[i + 1], 'index', ARGV[i + 2])
  end
end
return 0
"""
# KEYS: batch, open set; ARGV: from status, record, status, completed, failed, batch id
_FINISH = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'status', ARGV[3], 'completed', ARGV[4], 'failed', ARGV[5])
redis.call('SREM', KEYS[2], ARGV[6])
return 1
"""
# KEYS: batch; ARGV: record with status cancelling
_CANCEL = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'status', 'cancelling')
return 1
"""


def _split_prefix(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    prefix = next((v for k, v in query if k == "prefix"), "expresslane")
    rest = urlencode([(k, v) for k, v in query if k != "prefix"])
    return urlunsplit(parts._replace(query=rest)), prefix


class RedisStore(BatchStore):
    def __init__(self, url: str):
        url, self.prefix = _split_prefix(url)
        self.r = redis.Redis.from_url(url)
        self.r.ping()  # fail at start, with the address, when no server answers
        self.queue = self._k("queue")
        try:
            self.r.xgroup_create(self.queue, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._complete = self.r.register_script(_COMPLETE)
        self._renew = self.r.register_script(_RENEW)
        self._release = self.r.register_script(_RELEASE)
        self._finish_script = self.r.register_script(_FINISH)
        self._cancel = self.r.register_script(_CANCEL)
        self._autoclaim_from = "0-0"

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def close(self) -> None:
        self.r.close()

    # -- files --------------------------------------------------------------------------------
    def put_file(self, rec: FileRecord, content: bytes) -> None:
        with self.r.pipeline() as p:
            p.hset(self._k("file", rec.id), mapping={"meta": rec.to_json(), "content": content})
            p.zadd(self._k("files"), {rec.id: self.r.incr(self._k("seq"))})
            p.execute()

    def get_file(self, file_id: str) -> FileRecord | None:
        meta = self.r.hget(self._k("file", file_id), "meta")
        return None if meta is None else FileRecord.from_json(meta)

    def file_content(self, file_id: str) -> bytes | None:
        return self.r.hget(self._k("file", file_id), "content")

    def _page(self, zset: str, after: str | None, limit: int) -> list[str]:
        top = "+inf"
        if after is not None:
            score = self.r.zscore(zset, after)
            if score is None:
                return []
            top = f"({score}"
        return [i.decode() for i in self.r.zrevrangebyscore(zset, top, "-inf", start=0, num=limit)]

    def list_files(self, purpose: str | None, after: str | None, limit: int) -> list[FileRecord]:
        out: list[FileRecord] = []
        while len(out) < limit:  # filtering by purpose may need more than one page
            ids = self._page(self._k("files"), after, limit)
            if not ids:
                break
            with self.r.pipeline() as p:
                for i in ids:
                    p.hget(self._k("file", i), "meta")
                recs = [FileRecord.from_json(m) for m in p.execute() if m is not None]
            out += [f for f in recs if purpose is None or f.purpose == purpose]
            after = ids[-1]
        return out[:limit]

    def delete_file(self, file_id: str) -> bool:
        with self.r.pipeline() as p:
            p.delete(self._k("file", file_id))
            p.zrem(self._k("files"), file_id)
            return p.execute()[0] == 1

    # -- batches ------------------------------------------------------------------------------
    def add_batch(self, batch: BatchRecord, items: list[Item]) -> None:
        seq = self.r.incr(self._k("seq"))
        with self.r.pipeline(transaction=True) as p:
            p.hset(self._k("batch", batch.id), mapping={"record": batch.to_json(), "status": batch.status,
                                                        "completed": 0, "failed": 0})
            p.zadd(self._k("batches"), {batch.id: seq})
            if items:
                p.sadd(self._k("open"), batch.id)
                p.hset(self._k("items", batch.id), mapping={str(i.index): i.to_json() for i in items})
                for i in items:
                    p.xadd(self.queue, {"batch": batch.id, "index": i.index})
            p.execute()

    def _batches(self, ids: list[str]) -> list[BatchRecord]:
        with self.r.pipeline() as p:
            for i in ids:
                p.hmget(self._k("batch", i), "record", "status", "completed", "failed")
            rows = p.execute()
        out = []
        for record, status, completed, failed in rows:
            if record is None:
                continue
            b = BatchRecord.from_json(record)
            b.status, b.completed, b.failed = status.decode(), int(completed), int(failed)
            out.append(b)
        return out

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        found = self._batches([batch_id])
        return found[0] if found else None

    def list_batches(self, after: str | None, limit: int) -> list[BatchRecord]:
        return self._batches(self._page(self._k("batches"), after, limit))

    def open_batches(self) -> list[BatchRecord]:
        return self._batches([i.decode() for i in self.r.smembers(self._k("open"))])

    def set_cancelling(self, batch_id: str, now: int) -> BatchRecord | None:
        b = self.get_batch(batch_id)
        if b is None or b.status != "in_progress":
            return b
        b.status, b.cancelling_at = "cancelling", now
        if not self._cancel(keys=[self._k("batch", batch_id)], args=[b.to_json()]):
            return self.get_batch(batch_id)  # it finished meanwhile
        return b

    def _finish(self, batch: BatchRecord, from_status: str, files: list[tuple[FileRecord, bytes]]) -> bool:
        # Files first: their ids are the batch's own, so a finisher that loses the race (or dies
        # before the status changes) wrote the same files.
        for rec, content in files:
            self.put_file(rec, content)
        return bool(self._finish_script(keys=[self._k("batch", batch.id), self._k("open")],
                                        args=[from_status, batch.to_json(), batch.status, batch.completed,
                                              batch.failed, batch.id]))

    # -- the queue ----------------------------------------------------------------------------
    def claim(self, worker: str, n: int, lease: float, now: float) -> list[Item]:
        if n <= 0:
            return []
        # Entries whose owner has not renewed them for a lease: that server is gone.
        start, entries, _ = self.r.xautoclaim(self.queue, GROUP, worker, int(lease * 1000),
                                              start_id=self._autoclaim_from, count=n)
        self._autoclaim_from = start.decode() if isinstance(start, bytes) else start
        entries = [e for e in entries if e[1]]
        if len(entries) < n:
            read = self.r.xreadgroup(GROUP, worker, {self.queue: ">"}, count=n - len(entries))
            for _, new in read or []:
                entries += new
        if not entries:
            return []
        keys = [(f[b"batch"].decode(), f[b"index"].decode()) for _, f in entries]
        with self.r.pipeline() as p:
            for batch_id, index in keys:
                p.hget(self._k("batch", batch_id), "status")
                p.hget(self._k("items", batch_id), index)
            rows = p.execute()
        items, dropped = [], []
        for (entry_id, _), (batch_id, index), status, request in zip(entries, keys, rows[::2], rows[1::2]):
            entry_id = entry_id.decode()
            if status != b"in_progress" or request is None:
                dropped.append(entry_id)  # cancelled or finished batch: nothing to run
            else:
                items.append(Item.from_json(batch_id, int(index), request, entry_id))
        if dropped:
            with self.r.pipeline() as p:
                p.xack(self.queue, GROUP, *dropped)
                p.xdel(self.queue, *dropped)
                p.execute()
        return items

    def renew(self, worker: str, items: list[Item], lease: float, now: float) -> None:
        if items:
            self._renew(keys=[self.queue], args=[GROUP, worker, 0, *(i.token for i in items)])

    def release(self, worker: str, items: list[Item]) -> None:
        if items:
            args = [GROUP, worker]
            for i in items:
                args += [i.token, i.batch_id, i.index]
            self._release(keys=[self.queue], args=args)

    def complete(self, item: Item, result: ItemResult) -> bool:
        return bool(self._complete(keys=[self._k("batch", item.batch_id), self._k("results", item.batch_id),
                                         self.queue],
                                   args=[item.custom_id, result.to_json(), "completed" if result.ok else "failed",
                                         GROUP, item.token]))

    def results(self, batch_id: str) -> list[ItemResult]:
        return [ItemResult.from_json(v) for v in self.r.hvals(self._k("results", batch_id))]
