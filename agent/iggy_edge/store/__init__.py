"""The outbox: a durable, bounded SQLite buffer between MQTT and Iggy.

Design
------
* One database file (WAL mode) holds the outbox, the dead letters and a small
  meta table; the return path keeps its inbox and offsets in the same file
  (its own tables, see downlink/inbox.py).  Every connection, transaction and
  pragma goes through `db.py`: one aiosqlite connection per user (outbox,
  inbox) with one lock that serialises its statements, one transaction
  helper (BEGIN inside the try, ROLLBACK on error or cancellation), and the
  blocking equivalents for the CLI's buffer tools (buffer_admin.py), which may
  read beside the running agent (WAL).
* The package, by job: `db` (connections, transactions, pragmas), `schema`
  (tables, constants, opening the file), `recovery/` (a full disk versus a
  damaged file, salvage, the WAL header), `sources` (route and source ids:
  the one get-or-create), `devices` (per-device accounting), `bounds`
  (max_records / max_bytes, ttl_s), `dead` (dead letters), `commit`
  (ingest's group commit), `reader` (read a batch, confirm), `outbox` (puts
  them together: life cycle, the API the stages call).  `Outbox` is
  composed of parts that own their state and hold explicit references to
  the parts they need; base.py has the table of who owns and gets what.
* **Group commit.**  Ingest hands records over synchronously
  (`Outbox.take`: admission by the device bounds, redelivery recognition and
  the record's place in the open group, in one call; `submit` for tools and
  tests) in arrival order and awaits the commit of the group that contains
  them.  A committer task takes whatever is pending (up to
  `commit_max_records`), waits at most `commit_interval_ms` for more,
  writes them in one transaction and resolves one future for the whole group.
  The MQTT acknowledgement is sent only after that future resolves, so an
  acknowledged QoS1 message is always on disk.
* **Durability.**  Inserts commit with `PRAGMA synchronous=FULL` by default:
  the WAL is fsynced at every commit, so a committed record survives power
  loss.  Deletes (after Iggy confirmed) commit with `synchronous=NORMAL`: a
  delete lost to a power cut only means the record is sent again, with the
  same message id, which consumers already de-duplicate.  `synchronous =
  "normal"` in the config trades power-loss safety of the last commits for
  speed (crash safety remains); bench/ingest_bench.py measures both.
* **Identity.**  `seq` is an AUTOINCREMENT key, so it is never reused, even
  after the outbox empties; the message id is (gateway hash, epoch, seq), see
  records.py.  Forwarding reads in seq order, which is arrival order, so per
  partition key order holds across outages and restarts.
* **Rows and versions.**  An outbox row carries seq, a source id, flags,
  receive time, the device's seq and the payload; the source (route,
  partition key, MQTT topic -- the same for every reading of one device
  channel) is a row of `sources`, so these strings are stored once, not per
  record (schema version 2; 93 bytes on disk per 60-byte record, 129 with
  version 1).  `schema.migrate` converts a version 1 file in place, in one
  transaction, when the agent opens it; the CLI reads either version
  (`outbox_rows`, a view with the version 1 columns).
* **Bounds.**  `max_records` and `max_bytes` (accounted bytes = payload +
  topic + a fixed per-row overhead) are enforced at insert time with the
  configured policy: `drop_oldest` deletes the oldest records, `reject_new`
  refuses the new ones.  Records older than `ttl_s` are expired.  Every drop
  is counted by reason and logged (rate-limited).  Dead letters are bounded
  by count, oldest first, and written in groups like records
  (`enqueue_dead_letter`, at most 1000 letters or 4 MiB a group, payloads cut
  to max_payload_bytes on arrival); `pending_bytes` tells ingest how many
  payload bytes wait for a commit, so it can bound its work by bytes.
* **A failing disk is not a damaged file** (recovery/).  Errors are told
  apart by SQLite's error code: a full or failing disk leaves the file in
  place, the agent reports store=failed, acknowledges nothing and retries
  (`Outbox.open_when_possible`); only a corruption confirmed by
  integrity_check moves the file aside (`buffer.db.corrupt-<time>`), and what
  can be read is salvaged into the fresh buffer with its ids and order.  A
  -wal with a damaged header is copied aside before SQLite ignores it.  Both
  stay visible (health, `buffer stats`, metrics) until acknowledged
  (`iggy-edge buffer ack-salvage`).
"""

from .base import redelivery_key
from .commit import Incoming
from .db import Database, NoDatabase, StoreError, ro_connect, sync_transaction
from .outbox import Outbox
from .recovery import Event, StoreUnavailable, open_database
from .schema import ROW_OVERHEAD, SCHEMA, SCHEMA_VERSION, accounted_bytes, device_seq_of

__all__ = [
    "ROW_OVERHEAD",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Database",
    "Event",
    "Incoming",
    "NoDatabase",
    "Outbox",
    "StoreError",
    "StoreUnavailable",
    "accounted_bytes",
    "device_seq_of",
    "open_database",
    "redelivery_key",
    "ro_connect",
    "sync_transaction",
]
