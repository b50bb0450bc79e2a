"""`iggy-edge command send|list` and `config push`, run as the real CLI process."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from iggy_edge.config import Settings
from iggy_edge.downlink import return_path
from iggy_edge.downlink.commands import make_command, return_topic
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.runtime import Agent
from iggy_edge.uplink.factory import make_command_source, make_uplink

from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber, downlink_settings
from tests.support.iggy_server import IggyServer
from tests.support.provisioning import provision
from tests.support.wait import async_wait_until

CLI = str(Path(sys.executable).parent / "iggy-edge")


def write_config(tmp_path: Path, settings: Settings, iggy: dict[str, object]) -> Path:
    lines = [
        f'gateway_id = "{settings.gateway_id}"',
        f'state_dir = "{settings.state_dir}"',
        "[mqtt]",
        f'host = "{settings.mqtt.host}"',
        f"port = {settings.mqtt.port}",
        "[iggy]",
        *(f"{k} = {json.dumps(v)}" for k, v in iggy.items()),
    ]
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def cli(*args: str) -> tuple[int, str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}  # no IGGY_* from the caller's environment
    if "PYTHONPATH" in os.environ:  # a worktree's agent (helper-common.md), not the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = await asyncio.create_subprocess_exec(
        CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_send_refuses_a_memory_iggy_with_a_reason(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    conf = write_config(tmp_path, settings, {"kind": "memory"})
    code, _, err = await cli("command", "send", "-c", str(conf), "--device", "d1", "--name", "x")
    assert code == 2
    assert "memory Iggy lives inside the agent process" in err
    code, _, err = await cli("command", "send", "-c", str(conf), "-d", "d1", "--name", "x", "--args", "[1]")
    assert code == 2
    assert "JSON object" in err
    # too big for a device: refused before anything is sent, with the limit
    big = json.dumps({"blob": "x" * 5000})
    code, _, err = await cli("command", "send", "-c", str(conf), "-d", "d1", "--name", "x", "--args", big)
    assert code == 2
    assert "over the 4096-byte limit devices accept" in err
    desired = tmp_path / "big.json"
    desired.write_text(big)
    code, _, err = await cli("config", "push", str(desired), "-c", str(conf), "-d", "d1")
    assert code == 2
    assert "config for the device is 5011 bytes, over the 4096-byte limit" in err


async def test_list_shows_states_and_offsets(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    inbox = await Inbox.open(settings.buffer_path, settings)
    a, b = make_command("dev-a", "open"), make_command("dev-b", "close")
    await inbox.store_polled("edge", "commands.gw-test", 1, 7, [(a, "s"), (b, "s")])
    await inbox.set_mirrored("edge", "commands.gw-test", 1, 6)
    await inbox.close()
    conf = write_config(tmp_path, settings, {"kind": "none"})
    code, out, _ = await cli("command", "list", "-c", str(conf))
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split()[:4] == [b.id, "dev-b", "close", "received"]  # newest first
    assert lines[2].split()[:4] == [a.id, "dev-a", "open", "received"]
    assert "offset edge/commands.gw-test/1: 7 (server has 6)" in out
    code, out, _ = await cli("command", "list", "-c", str(conf), "--json", "--device", "dev-a")
    assert [json.loads(x)["id"] for x in out.splitlines()] == [a.id]


@pytest.mark.iggy
async def test_send_and_push_through_a_real_iggy_server(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    iggy: dict[str, object] = {
        "kind": "iggy",
        "address": iggy_server.address,
        "username": iggy_server.username,
        "password": iggy_server.password,
    }
    settings = downlink_settings(tmp_path, broker, iggy=iggy)
    conf = write_config(tmp_path, settings, iggy)
    code, _, err = await cli("command", "send", "-c", str(conf), "-d", "dev-9", "--name", "early")
    assert code == 1
    assert "provision the gateway first: iggy-edge cloud provision-gateway --gateway gw-test" in err
    await provision(settings)
    rt = return_topic(settings)
    agent = Agent(
        settings,
        uplink=make_uplink(settings),
        command_source=make_command_source(settings),
        components=(return_path,),
    )
    task = asyncio.create_task(agent.run())
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/dev-9/down/#").start()
    try:
        code, out, err = await cli(
            "command",
            "send",
            "-c",
            str(conf),
            "-d",
            "dev-9",
            "--name",
            "relay",
            "--json",
            "--args",
            '{"on": true}',
            "--ttl",
            "60",
        )
        assert code == 0, err
        sent = json.loads(out)
        assert (sent["stream"], sent["topic"], sent["partition"]) == (rt.stream, "return.gw-test", 0)
        desired = tmp_path / "desired.json"
        desired.write_text('{"period_s": 15}')
        code, out, err = await cli("config", "push", "-c", str(conf), "-d", "dev-9", str(desired))
        assert code == 0, err
        await async_wait_until(lambda: len(dev.messages) == 2, timeout=30, what="command and config arrive")
        by_topic = {m.topic: m for m in dev.messages}
        assert by_topic["edge/dev-9/down/cmd"].doc["id"] == sent["id"]
        assert by_topic["edge/dev-9/down/cmd"].doc["args"] == {"on": True}
        assert by_topic["edge/dev-9/down/config"].doc == {"period_s": 15}

        async def listed_delivered() -> bool:
            _, out, _ = await cli("command", "list", "-c", str(conf), "--json")
            return any(json.loads(x)["state"] == "delivered" for x in out.splitlines())

        deadline = asyncio.get_running_loop().time() + 30
        while not await listed_delivered():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("command list never showed the command as delivered")
            await asyncio.sleep(0.1)
    finally:
        await dev.stop()
        agent.stop()
        await asyncio.wait_for(task, 20)
