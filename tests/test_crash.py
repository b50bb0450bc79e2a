"""THE crash test: SIGKILL the agent while devices publish QoS1 messages,
restart it each time, and prove that every message the broker acknowledged
to a publisher reaches the uplink at least once, under one stable message
id, in per-device order.

The agent runs as `iggy-edge run` in a subprocess with the file uplink
(fsynced JSON lines), so the evidence survives each SIGKILL.  While the
agent is dead the broker queues for its persistent session (the broker
fixture raises max_queued_messages, as the shipped config does).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from iggy_edge.uplink.file import read_records

from tests.support.broker import Broker
from tests.support.mqtt import Publisher
from tests.support.wait import async_wait_until

AGENT = str(Path(sys.executable).with_name("iggy-edge"))
DEVICES = [f"dev-crash-{i}" for i in range(4)]
PER_DEVICE = 500
KILLS = 4


def write_config(tmp_path: Path, broker: Broker) -> tuple[Path, Path]:
    uplink = tmp_path / "uplink.jsonl"
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f"""
gateway_id = "gw-crash"
state_dir = "{tmp_path / "state"}"
[mqtt]
host = "{broker.host}"
port = {broker.port}
reconnect_min_s = 0.1
reconnect_max_s = 0.5
[iggy]
kind = "file"
file_path = "{uplink}"
[forward]
batch_records = 100
linger_ms = 5
backoff_initial_s = 0.05
backoff_max_s = 0.2
[metrics]
enabled = false
[downlink]
enabled = false
"""
    )
    return cfg, uplink


class AgentProcess:
    def __init__(self, cfg: Path, log: Path) -> None:
        self.cfg = cfg
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([AGENT, "run", "-c", str(self.cfg)], stdout=out, stderr=out)
        self.starts += 1

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 20) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def lines_by_key(uplink: Path) -> list[tuple[str, int, str]]:
    out = []
    for line in read_records(uplink):
        if line["topic"] == "telemetry":
            out.append((line["key"], int(line["headers"]["device-seq"]), line["message_id"]))
    return out


async def test_sigkill_during_stream_loses_nothing(tmp_path: Path, broker: Broker) -> None:
    cfg, uplink = write_config(tmp_path, broker)
    agent = AgentProcess(cfg, tmp_path / "agent.log")
    rng = random.Random(int(os.environ.get("CRASH_SEED", "7")))
    agent.start()
    try:
        # Until the agent's session is subscribed (a probe arrives), nothing is queued for it.
        probe = await Publisher(broker.host, broker.port, "pub-probe").connect()
        n = 0

        def probe_arrived() -> bool:
            return any(k == "probe" for k, _, _ in lines_by_key(uplink))

        while not probe_arrived():
            n += 1
            assert n < 100, "agent never subscribed; see agent.log"
            await probe.publish("edge/probe/up/env", b'{"seq":%d}' % n)
            await asyncio.sleep(0.2)
        await probe.close()

        pub = await Publisher(broker.host, broker.port, "pub-crash").connect()

        async def publish() -> None:
            for seq in range(PER_DEVICE):
                for d in DEVICES:
                    await pub.publish(
                        f"edge/{d}/up/env", json.dumps({"seq": seq, "v": seq * 0.5}).encode(), tag=(d, seq)
                    )
                await asyncio.sleep(0.01)
            await pub.wait_all_acked(30)

        publishing = asyncio.create_task(publish())
        for _ in range(KILLS):
            await asyncio.sleep(rng.uniform(0.3, 1.3))
            agent.kill()
            await asyncio.sleep(rng.uniform(0.0, 0.5))  # the broker queues meanwhile
            agent.start()
        await publishing
        await pub.close()
        acked = set(pub.acked)
        assert len(acked) == len(DEVICES) * PER_DEVICE

        def drained() -> bool:
            return acked <= {(k, s) for k, s, _ in lines_by_key(uplink)}

        await async_wait_until(drained, 60, interval=0.2, what="every acknowledged message in the uplink")
        assert agent.terminate() == 0, "SIGTERM must stop the agent cleanly"
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()

    rows = [r for r in lines_by_key(uplink) if r[0] != "probe"]
    ids: dict[tuple[str, int], str] = {}
    for key, seq, mid in rows:
        assert ids.setdefault((key, seq), mid) == mid, f"{key} seq {seq} was stored under two ids"
    assert set(ids) == acked  # every acknowledged message, at least once
    assert len(set(ids.values())) == len(acked)  # the distinct ids cover them one to one
    for d in DEVICES:
        firsts: list[int] = []
        seen: set[int] = set()
        for key, seq, _ in rows:
            if key == d and seq not in seen:
                seen.add(seq)
                firsts.append(seq)
        assert firsts == list(range(PER_DEVICE)), f"{d}: first appearances out of order"
    assert agent.starts == KILLS + 1
    print(f"crash test: {len(rows)} lines for {len(acked)} messages ({len(rows) - len(acked)} duplicates)")
