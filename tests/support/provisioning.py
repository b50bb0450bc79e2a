"""The cloud side's set-up of a gateway on a real iggy-server, for tests:
`provision` runs `iggy-edge cloud provision-gateway`'s library function with
the server's root user; `gateway_settings` are the agent's settings with the
gateway's own least-privileged credential instead."""

from __future__ import annotations

from typing import Any

from iggy_edge.cloud.provision import Provisioned, provision_gateway
from iggy_edge.config import Settings
from pydantic import SecretStr


async def provision(settings: Settings, gateway_id: str | None = None, **kwargs: Any) -> Provisioned:
    """Provision `gateway_id` (default: the settings' own) with `settings.iggy`'s (admin) login."""
    return await provision_gateway(settings, gateway_id or settings.gateway_id, **kwargs)


def gateway_settings(settings: Settings, provisioned: Provisioned) -> Settings:
    """`settings` logged in as the provisioned gateway user, with creation off."""
    assert provisioned.password is not None
    iggy = settings.iggy.model_copy(
        update={
            "username": provisioned.username,
            "password": SecretStr(provisioned.password),
            "create_missing": False,
        }
    )
    return settings.model_copy(update={"iggy": iggy})
