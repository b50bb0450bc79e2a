"""The settings that name device topics follow `topic_prefix`.

The boards build their topics from their own `topic_prefix`
(device/iggy_device) and the packaged broker ACL lets a device write only
``{prefix}/<id>/up/#`` and ``.../status`` and read only ``.../down/#``
(topics.py).  So a per-topic key that says anything else is not a choice
but a silent fault: a `receipts.topic` of ``other/{device}/r`` loaded, and
no board ever heard a receipt.  Here each such key defaults from the layout
and a value that disagrees is refused under its own key, with the fix.

The subscriptions and the routes are the user's to choose (the agent may
listen to more than the devices), but their defaults follow the prefix too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from ..topics import DEFAULT_PREFIX, TopicLayout, prefix_problem
from .sections import default_routes, default_subscriptions

_Section = TypeVar("_Section", bound=BaseModel)

# section -> key -> (its value under a layout, what it is)
BOUND: Final[dict[str, dict[str, tuple[Callable[[TopicLayout], str], str]]]] = {
    "downlink": {
        "command_topic": (lambda t: t.command_template, "the command topic"),
        "config_mqtt_topic": (lambda t: t.config_template, "the desired-config topic"),
        "ack_filter": (lambda t: t.ack_filter, "the ack filter"),
    },
    "receipts": {"topic": (lambda t: t.receipt_template, "the receipt topic")},
}


def layout_of(prefix: object) -> TopicLayout | None:
    """The layout of a raw `topic_prefix`, or None when it is not one (its
    own validator reports that)."""
    return TopicLayout(prefix) if isinstance(prefix, str) and prefix_problem(prefix) is None else None


def routes_default(data: Any) -> Any:
    """Before validation: the default routes under the file's prefix."""
    if isinstance(data, dict) and "routes" not in data:
        layout = layout_of(data.get("topic_prefix", DEFAULT_PREFIX))
        if layout is not None:
            return {**data, "routes": default_routes(layout)}
    return data


def disagreement(key: str, value: str, layout: TopicLayout, shape: Callable[[TopicLayout], str]) -> str:
    """What to say of a `key` whose `value` is not its layout's."""
    want = shape(layout)
    suffix = want[len(layout.prefix) :]
    other = layout_of(value[: -len(suffix)]) if value.endswith(suffix) else None
    fix = (
        f'set topic_prefix = "{other.prefix}" and leave {key} out'
        if other is not None and shape(other) == value
        else f"leave {key} out (it follows topic_prefix), or set topic_prefix to move every device topic"
    )
    return (
        f"{value!r} is not where the devices are under topic_prefix {layout.prefix!r}: the boards and "
        f"the broker's ACL use {want!r}; {fix}"
    )


def follow(section_name: str, section: _Section, layout: TopicLayout) -> _Section:
    """`section` with its device topics from `layout`: an unset key takes the
    layout's value, a set one must agree (a ValidationError under its key)."""
    update: dict[str, Any] = {}
    errors: list[InitErrorDetails] = []
    for key, (shape, _what) in BOUND.get(section_name, {}).items():
        value = getattr(section, key)
        if key not in section.model_fields_set:
            update[key] = shape(layout)
        elif value != shape(layout):
            message = disagreement(f"{section_name}.{key}", value, layout, shape)
            error = PydanticCustomError("topic_layout", "{message}", {"message": message})
            errors.append(InitErrorDetails(type=error, loc=(key,), input=value))
    if section_name == "mqtt" and "subscriptions" not in section.model_fields_set:
        update["subscriptions"] = default_subscriptions(layout)
    if errors:
        raise ValidationError.from_exception_data(type(section).__name__, errors)
    return section.model_copy(update=update) if update else section
