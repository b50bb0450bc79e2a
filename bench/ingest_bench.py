"""Ingest: messages/s from Mosquitto committed to SQLite by the agent, against
a bare gmqtt subscriber on the same broker that only counts.

Method (preload, so neither the publisher nor its pacing is measured):

1. A fresh Mosquitto (in memory, unlimited queues).  Two persistent sessions
   are registered and go offline: the agent's client id and the bare
   subscriber's, both subscribed to ``edge/+/up/#`` at QoS1.
2. `_publisher.py` publishes N messages (10 devices, 60-byte JSON with a
   device ``"seq"``); the broker queues each for both sessions.  Its rate is
   reported (``publish_rate``) to show it is not what limits anything.
3. Each subject, in its own fresh process, reconnects and drains its queue:
   the agent (the real `Agent`: gmqtt ingest -> routing -> Outbox group
   commit, acknowledge after commit, no uplink) and the bare subscriber
   (gmqtt defaults: optimistic acknowledgement, a plain callback that
   counts).  The time is from the first message received to the N-th
   committed (agent) or counted (bare).  The order of the two alternates
   between repeats.

Scenarios: QoS1 with ``synchronous=full`` (the default: a committed record
survives power loss) and ``=normal`` (the cost of full), and QoS0.  A
scenario ending in ``-receipts-off`` runs the agent with ``[receipts]
enabled = false`` (receipts.py), e.g. ``--scenarios
qos1-full,qos1-full-receipts-off`` for the cost of delivery receipts.  For QoS0
the broker is configured with ``queue_qos0_messages true`` so QoS0 messages
are queued for the offline sessions too (Mosquitto's default would drop
them); QoS0 has no in-flight window, so the agent may drop records beyond its
pending limit -- reported as ``dropped``.

    .venv/bin/python bench/ingest_bench.py [--quick] [--count N] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gmqtt
from _common import PYTHON, emit, emit_machine, spread
from _common import broker as make_broker
from gmqtt.mqtt.constants import MQTTv50
from iggy_edge.config import parse_config
from iggy_edge.runtime import Agent

BENCH = "ingest"
FILTER = "edge/+/up/#"
AGENT_ID = "iggy-edge-bench"
BARE_ID = "bench-bare"
SESSION_EXPIRY = 3600


# -- subjects (each runs in its own process) ------------------------------------


def cpu_s() -> float:
    """CPU seconds of this process, all threads (the agent's SQLite thread too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _agent_subject(
    port: int, state: Path, sync: str, expect: int, qos: int, receipts: bool = True
) -> dict[str, Any]:
    settings = parse_config(
        {
            "gateway_id": "bench",
            "state_dir": str(state),
            "mqtt": {
                "port": port,
                "client_id": AGENT_ID,
                "subscriptions": [{"filter": FILTER, "qos": 1}],
            },
            "iggy": {"kind": "none"},
            "buffer": {"synchronous": sync},
            "downlink": {"enabled": False},
            "receipts": {"enabled": receipts},
            "metrics": {"enabled": False},
        },
        env={},
    )
    agent = Agent(settings)
    task = asyncio.create_task(agent.run())
    await agent.ready.wait()
    outbox = agent.outbox
    assert outbox is not None
    base = outbox.records
    received = agent.metrics.ingest_messages.labels(str(qos))
    dropped = agent.metrics.dropped.labels("qos0_queue_full")
    first = last_change = None
    cpu0 = cpu_s()
    done = 0
    seen = 0
    deadline = time.perf_counter() + 600
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.002)
        now = time.perf_counter()
        # prometheus_client has no cheap public read; collecting the registry every 2 ms would
        # perturb what is measured.
        got = received._value.get()  # noqa: SLF001
        if first is None and (outbox.pending_count or outbox.records > base or got):
            first = now
            cpu0 = cpu_s()
        committed = outbox.records - base
        lost = int(dropped._value.get())  # noqa: SLF001 - as above
        if committed + lost != seen:
            seen = committed + lost
            last_change = now
        if committed + lost >= expect:
            done = committed
            break
        if last_change is not None and now - last_change > 30.0:  # stalled: report what we have
            done = committed
            now = last_change
            break
    end = now
    cpu = cpu_s() - cpu0
    agent.stop()
    await task
    return {
        "seconds": end - (first or end),
        "cpu_s": cpu,
        "committed": done,
        "dropped": int(
            agent.metrics.value("iggy_edge_store_dropped_records_total", reason="qos0_queue_full")
        ),
    }


async def _bare_subject(port: int, expect: int) -> dict[str, Any]:
    count = 0
    first = end = 0.0
    finished = asyncio.get_running_loop().create_future()

    cpu = [0.0, 0.0]

    def on_message(client: Any, topic: str, payload: bytes, qos: int, properties: Any) -> int:
        nonlocal count, first, end
        if count == 0:
            first = time.perf_counter()
            cpu[0] = cpu_s()
        count += 1
        if count >= expect and not finished.done():
            end = time.perf_counter()
            cpu[1] = cpu_s()
            finished.set_result(None)
        return 0

    client = gmqtt.Client(BARE_ID, clean_session=False, session_expiry_interval=SESSION_EXPIRY)
    client.on_message = on_message
    await client.connect("127.0.0.1", port, version=MQTTv50)
    try:
        await asyncio.wait_for(finished, 600)
    except TimeoutError:
        end = time.perf_counter()
    await client.disconnect()
    return {"seconds": end - first, "cpu_s": cpu[1] - cpu[0], "committed": count, "dropped": 0}


# -- orchestration -----------------------------------------------------------------


async def _register(port: int) -> None:
    """Create both persistent sessions with their subscription, then go offline."""
    for cid in (AGENT_ID, BARE_ID):
        client = gmqtt.Client(cid, clean_session=False, session_expiry_interval=SESSION_EXPIRY)
        subscribed = asyncio.get_running_loop().create_future()
        client.on_subscribe = lambda *_a, f=subscribed: f.done() or f.set_result(None)
        await client.connect("127.0.0.1", port, version=MQTTv50)
        client.subscribe(FILTER, qos=1)
        await asyncio.wait_for(subscribed, 10)
        await client.disconnect()


def _run_subject(args: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [PYTHON, __file__, *args], check=True, capture_output=True, text=True, timeout=900
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def one_round(
    workdir: Path, *, qos: int, sync: str, count: int, agent_first: bool, receipts: bool = True
) -> dict[str, Any]:
    with make_broker(workdir / "broker", queue_qos0=(qos == 0)) as broker:
        asyncio.run(_register(broker.port))
        pub = json.loads(
            subprocess.run(
                [
                    PYTHON,
                    str(Path(__file__).with_name("_publisher.py")),
                    "--port",
                    str(broker.port),
                    "--count",
                    str(count),
                    "--qos",
                    str(qos),
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            ).stdout
        )
        state = workdir / "state"
        agent_args = ["--role", "agent", "--port", str(broker.port), "--state", str(state)]
        agent_args += ["--sync", sync, "--count", str(count), "--qos", str(qos)]
        agent_args += ["--receipts", "on" if receipts else "off"]
        bare_args = ["--role", "bare", "--port", str(broker.port), "--count", str(count)]
        results: dict[str, Any] = {"publish_rate": pub["rate"]}
        for name, args in (("agent", agent_args), ("bare", bare_args))[:: 1 if agent_first else -1]:
            results[name] = _run_subject(args)
        return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scenarios", default="qos1-full,qos1-normal,qos0")
    ap.add_argument("--role", choices=("agent", "bare"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--sync", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--qos", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--receipts", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.role == "agent":
        subject = _agent_subject(a.port, a.state, a.sync, a.count, a.qos, a.receipts == "on")
        print(json.dumps(asyncio.run(subject)))
        return
    if a.role == "bare":
        print(json.dumps(asyncio.run(_bare_subject(a.port, a.count))))
        return

    count, repeat = (2000, 1) if a.quick else (a.count, a.repeat)
    emit_machine(BENCH)
    for scenario in a.scenarios.split(","):
        fig = scenario.replace("-", "_")
        receipts = not scenario.endswith("-receipts-off")
        base = scenario.removesuffix("-receipts-off")
        qos = 0 if base == "qos0" else 1
        sync = "normal" if base.endswith("normal") else "full"
        agent_rates: list[float] = []
        bare_rates: list[float] = []
        ratios: list[float] = []
        pub_rates: list[float] = []
        dropped: list[int] = []
        agent_cpu: list[float] = []
        bare_cpu: list[float] = []
        for r in range(repeat):
            with tempfile.TemporaryDirectory(prefix="iggy-edge-bench-") as tmp:
                res = one_round(
                    Path(tmp), qos=qos, sync=sync, count=count, agent_first=r % 2 == 0, receipts=receipts
                )
            agent, bare = res["agent"], res["bare"]
            ar = agent["committed"] / agent["seconds"] if agent["seconds"] else 0.0
            br = bare["committed"] / bare["seconds"] if bare["seconds"] else 0.0
            agent_rates.append(ar)
            bare_rates.append(br)
            ratios.append(ar / br if br else 0.0)
            pub_rates.append(res["publish_rate"])
            dropped.append(agent["dropped"])
            agent_cpu.append(agent["cpu_s"] / max(1, agent["committed"]) * 1e6)
            bare_cpu.append(bare["cpu_s"] / max(1, bare["committed"]) * 1e6)
        ref = spread(bare_rates, 0)
        common = {"count": count, "repeats": repeat, "qos": qos, "receipts": receipts}
        if qos:
            common["synchronous"] = sync
        else:
            common["broker"] = "queue_qos0_messages true"
        emit(
            BENCH,
            f"{fig}_rate",
            ref_value(agent_rates),
            "msg/s",
            reference=ref["median"],
            reference_name="bare gmqtt subscriber (optimistic ack, counting)",
            spread=spread(agent_rates, 0),
            reference_spread=ref,
            **common,
        )
        emit(
            BENCH,
            f"{fig}_ratio",
            round(ref_value(ratios, 3), 3),
            "agent/bare",
            target=0.95,
            spread=spread(ratios, 3),
            **common,
        )
        # CPU per message (user + system, every thread) is far steadier than
        # the rates on a machine other work shares: it is what the rates
        # would follow on an otherwise idle gateway.
        emit(
            BENCH,
            f"{fig}_cpu_per_msg",
            round(ref_value(agent_cpu, 2), 2),
            "us",
            reference=round(ref_value(bare_cpu, 2), 2),
            reference_name="bare gmqtt subscriber",
            spread=spread(agent_cpu, 2),
            reference_spread=spread(bare_cpu, 2),
            **common,
        )
        emit(
            BENCH,
            f"{fig}_publish_rate",
            ref_value(pub_rates),
            "msg/s",
            note="publisher into the broker queue (preload), not a limit on the drain",
            spread=spread(pub_rates, 0),
            **common,
        )
        if qos == 0:
            emit(
                BENCH,
                f"{fig}_dropped",
                max(dropped),
                "records",
                note="QoS0 dropped by the agent's pending limit (max over repeats)",
                **common,
            )


def ref_value(values: list[float], digits: int = 0) -> float:
    return spread(values, digits)["median"]  # type: ignore[no-any-return]


if __name__ == "__main__":
    main()
