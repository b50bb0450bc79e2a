"""The updater's side of ``ota.db`` (requests.py holds the schema and the
requests): aiosqlite through store/db.py's `Database`, one connection of
its own, every change of an update's state and progress committed before
the next message goes to its board, so a restarted agent resumes.

The rollout rule lives here too (`admissible`): an update of wave N starts
only when every update of the waves before it in its rollout finished and
the rollout's failures are within its bound; past the bound the rollout
stops and its updates still queued are cancelled (`stop_rollout`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..store.db import Database
from .artifact import Artifact
from .requests import SCHEMA, TERMINAL

_ACTIVE = "state NOT IN ('done', 'rolled_back', 'failed', 'cancelled')"
_FAILED = "state IN ('rolled_back', 'failed')"


@dataclass
class Row:
    id: str
    device: str
    artifact: str
    rollout: str
    wave: int
    state: str
    done_bytes: int
    cancel: bool


_COLUMNS = "id, device, artifact, rollout, wave, state, done_bytes, cancel"


def _row(r: Any) -> Row:
    return Row(r[0], r[1], r[2], r[3], int(r[4]), r[5], int(r[6]), bool(r[7]))


class OtaState:
    def __init__(self, db: Database) -> None:
        self._db = db

    @classmethod
    async def open(cls, path: Path) -> OtaState:
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(await Database.connect(path, busy_timeout_ms=10000, synchronous="NORMAL", schema=SCHEMA))

    async def close(self) -> None:
        await self._db.close()

    async def active(self) -> list[Row]:
        """Every update not finished, oldest first (queued ones too)."""
        found = await self._db.fetchall(
            f"SELECT {_COLUMNS} FROM ota_updates WHERE {_ACTIVE} ORDER BY created_at, id"  # noqa: S608
        )
        return [_row(r) for r in found]

    async def artifact(self, aid: str) -> Artifact | None:
        head = await self._db.fetchall("SELECT version, mpy, source FROM ota_artifacts WHERE id = ?", (aid,))
        if not head:
            return None
        files = await self._db.fetchall(
            "SELECT path, data FROM ota_files WHERE artifact = ? ORDER BY idx", (aid,)
        )
        version, mpy, source = head[0]
        return Artifact(version, tuple((p, bytes(d)) for p, d in files), mpy, source)

    async def save(
        self,
        uid: str,
        state: str,
        done_bytes: int,
        *,
        board_version: str | None = None,
        reason: str | None = None,
    ) -> None:
        sets, params = ["state = ?", "done_bytes = ?", "updated_at = ?"], [state, done_bytes, time.time()]
        if board_version is not None:
            sets.append("board_version = ?")
            params.append(board_version)
        if reason is not None:
            sets.append("reason = ?")
            params.append(reason)
        async with self._db.write() as conn:
            await conn.execute(f"UPDATE ota_updates SET {', '.join(sets)} WHERE id = ?", (*params, uid))  # noqa: S608

    async def admissible(self, row: Row) -> bool | str:
        """True when `row` may start now; a reason string when its rollout
        stopped (it is to be cancelled); False while an earlier wave runs."""
        async with self._db.lock:
            head = await self._db.fetchone(
                "SELECT max_failures, state FROM ota_rollouts WHERE id = ?", (row.rollout,)
            )
            failed = await self._db.fetchone(
                f"SELECT count(*) FROM ota_updates WHERE rollout = ? AND {_FAILED}",  # noqa: S608
                (row.rollout,),
            )
            earlier = await self._db.fetchone(
                f"SELECT count(*) FROM ota_updates WHERE rollout = ? AND wave < ? AND {_ACTIVE}",  # noqa: S608
                (row.rollout, row.wave),
            )
        if head is None:
            return True
        max_failures, rstate = int(head[0]), head[1]
        if rstate == "stopped" or int(failed[0]) > max_failures:
            return f"rollout {row.rollout} stopped: {int(failed[0])} board(s) failed, bound {max_failures}"
        return int(earlier[0]) == 0

    async def failures_passed(self, rollout: str) -> str | None:
        """The stop reason when `rollout`'s failures passed its bound, else None."""
        async with self._db.lock:
            head = await self._db.fetchone("SELECT max_failures FROM ota_rollouts WHERE id = ?", (rollout,))
            failed = await self._db.fetchone(
                f"SELECT count(*) FROM ota_updates WHERE rollout = ? AND {_FAILED}",  # noqa: S608
                (rollout,),
            )
        if head is None or int(failed[0]) <= int(head[0]):
            return None
        return f"rollout {rollout} stopped: {int(failed[0])} board(s) failed, bound {int(head[0])}"

    async def stop_rollout(self, rollout: str, reason: str) -> int:
        """Mark `rollout` stopped and cancel its updates still queued; how many."""
        now = time.time()
        async with self._db.write() as conn:
            await conn.execute(
                "UPDATE ota_rollouts SET state = 'stopped', reason = ?, updated_at = ?"
                " WHERE id = ? AND state = 'running'",
                (reason, now, rollout),
            )
            cur = await conn.execute(
                "UPDATE ota_updates SET state = 'cancelled', reason = ?, updated_at = ?"
                " WHERE rollout = ? AND state = 'queued'",
                (reason, now, rollout),
            )
            return int(cur.rowcount)

    async def finish_rollouts(self) -> None:
        """Rollouts whose updates all finished are ``finished``."""
        async with self._db.write() as conn:
            await conn.execute(
                "UPDATE ota_rollouts SET state = 'finished', updated_at = ? WHERE state = 'running'"  # noqa: S608
                " AND NOT EXISTS (SELECT 1 FROM ota_updates u"
                f" WHERE u.rollout = ota_rollouts.id AND u.{_ACTIVE})",
                (time.time(),),
            )


__all__ = ["TERMINAL", "OtaState", "Row"]
