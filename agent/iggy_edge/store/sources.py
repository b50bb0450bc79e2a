"""Sources: the one place a (route, partition key, MQTT topic) gets its id.

Every writer of outbox rows -- the group commit (base.py), the salvage of a
damaged file (recovery/salvage.py) and the CLI's dead-letter replay
(buffer_admin.py) -- takes its source id from `SOURCE_ID_SQL`: one upsert
that returns the id of the existing row or of the one it creates, one round
trip either way.  Sources no row refers to are deleted (`ORPHANS_SQL`) when
the outbox opens and when a device's bound needs their room (devices.py).
"""

from __future__ import annotations

import sqlite3
from typing import Final

SOURCE_ID_SQL: Final = (
    "INSERT INTO sources(route_id, pkey, mqtt_topic) VALUES (?, ?, ?)"
    " ON CONFLICT(route_id, pkey, mqtt_topic) DO UPDATE SET pkey = excluded.pkey RETURNING id"
)
# Sources without a row (the index outbox_by_source makes each probe a lookup).
ORPHANS_SQL: Final = (
    "DELETE FROM sources WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE source_id = sources.id)"
)


def source_id_sync(conn: sqlite3.Connection, route_id: int, pkey: str, mqtt_topic: str) -> int:
    """The id of a source on a blocking connection (created when new)."""
    (sid,) = conn.execute(SOURCE_ID_SQL, (route_id, pkey, mqtt_topic)).fetchone()
    return int(sid)
