"""The device topic layout, in one place.

Every device's topics hang off one prefix (``edge`` unless ``topic_prefix``
says otherwise), and the device library (device/iggy_device/codec.py) builds
the same names from the same prefix:

===================================  ==========  =================================
topic                                who writes  what
===================================  ==========  =================================
``{prefix}/{device}/up/{channel}``   the device  telemetry (``seq`` in each JSON)
``{prefix}/{device}/up/ack``         the device  command acknowledgements
``{prefix}/{device}/up/ota``         the device  update replies (ota/), not telemetry
``{prefix}/{device}/status``         the device  ``online`` / ``offline``, retained
``{prefix}/{device}/down/cmd``       the agent   commands (return path)
``{prefix}/{device}/down/config``    the agent   desired config, retained
``{prefix}/{device}/down/receipt``   the agent   delivery receipts, retained
``{prefix}/{device}/down/ota``       the agent   update manifest and chunks (ota/)
===================================  ==========  =================================

The packaged broker ACL gives each device exactly its own subtree
(`acl_patterns`): it may write ``up/#`` and ``status`` and read ``down/#``.
So a topic the agent publishes to a device outside ``down/`` would never
reach it, and a reading outside ``up/`` would be refused by the broker:
ingest, receipts, the return path, `device credentials` (the ACL) and doctor
all take their names from a `TopicLayout` rather than spelling them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

DEFAULT_PREFIX: Final = "edge"
# The MQTT topic travels to Iggy as a header value, capped at 255 bytes
# (routing.py).  A device id is at most 64 characters (device_ids.py) and a
# channel at most 32 (the device library's codec), so with "/" + id + "/up/"
# + channel (101 bytes) a prefix of at most 128 keeps every reading's topic
# under that cap.
MAX_PREFIX_BYTES: Final = 128


def prefix_problem(prefix: object) -> str | None:
    """Why `prefix` cannot be a topic prefix, or None when it can."""
    if not isinstance(prefix, str):
        return f"the topic prefix must be a string, not {type(prefix).__name__}"
    if not prefix:
        return "the topic prefix must not be empty"
    if len(prefix.encode("utf-8", "surrogatepass")) > MAX_PREFIX_BYTES:
        return f"the topic prefix must be at most {MAX_PREFIX_BYTES} bytes"
    if prefix.startswith("/") or prefix.endswith("/") or "//" in prefix:
        return f"the topic prefix {prefix!r} must not start or end with '/' or have an empty level"
    if any(c in "+#\x00" or c < " " or c == "\x7f" for c in prefix):
        return f"the topic prefix {prefix!r} must not contain '+', '#' or control characters"
    if not prefix.isascii():
        return f"the topic prefix {prefix!r} must be ASCII (the board's umqtt.simple writes bytes as given)"
    return None


@dataclass(frozen=True, slots=True)
class TopicLayout:
    """The names of every device's topics under `prefix`."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        problem = prefix_problem(self.prefix)
        if problem is not None:
            raise ValueError(problem)

    # -- what the agent subscribes to ------------------------------------------

    @property
    def head(self) -> str:
        """What stands before the device id: ``edge/``."""
        return self.prefix + "/"

    @property
    def up_filter(self) -> str:
        return f"{self.prefix}/+/up/#"

    @property
    def ack_filter(self) -> str:
        return f"{self.prefix}/+/up/ack"

    @property
    def status_filter(self) -> str:
        return f"{self.prefix}/+/status"

    # -- one device's topics -----------------------------------------------------

    def up(self, device: str, channel: str) -> str:
        return f"{self.prefix}/{device}/up/{channel}"

    def status(self, device: str) -> str:
        return f"{self.prefix}/{device}/status"

    def command(self, device: str) -> str:
        return f"{self.prefix}/{device}/down/cmd"

    def config(self, device: str) -> str:
        return f"{self.prefix}/{device}/down/config"

    def receipt(self, device: str) -> str:
        return f"{self.prefix}/{device}/down/receipt"

    def ota(self, device: str) -> str:
        """Where the agent sends a board its update (ota/protocol.py)."""
        return f"{self.prefix}/{device}/down/ota"

    def ota_reply(self, device: str) -> str:
        return f"{self.prefix}/{device}/up/ota"

    # -- templates, for settings that still take ``{device}`` ---------------------

    @property
    def command_template(self) -> str:
        return self.command("{device}")

    @property
    def config_template(self) -> str:
        return self.config("{device}")

    @property
    def receipt_template(self) -> str:
        return self.receipt("{device}")

    # -- reading a topic back ----------------------------------------------------

    def device_of_up(self, topic: str) -> str | None:
        """The device level of ``{prefix}/{device}/up/...``, or None for any
        other topic.  On the hot path: string operations only."""
        head = self.prefix + "/"
        if not topic.startswith(head):
            return None
        start = len(head)
        i = topic.find("/", start)
        if i <= start or not topic.startswith("/up/", i):
            return None
        return topic[start:i]

    def device_of_status(self, topic: str) -> str | None:
        """The device level of ``{prefix}/{device}/status``, or None."""
        head = self.prefix + "/"
        if not topic.startswith(head) or not topic.endswith("/status"):
            return None
        device = topic[len(head) : -len("/status")]
        if not device or "/" in device:
            return None
        return device

    def device_of_ack(self, topic: str) -> str | None:
        """The device level of ``{prefix}/{device}/up/ack``, or None."""
        device = self.device_of_up(topic)
        if device is None or topic != f"{self.prefix}/{device}/up/ack":
            return None
        return device

    def device_of_ota_reply(self, topic: str) -> str | None:
        """The device level of ``{prefix}/{device}/up/ota``, or None.  On
        ingest's hot path: one ``endswith`` for every other topic."""
        if not topic.endswith("/up/ota"):
            return None
        device = self.device_of_up(topic)
        if device is None or topic != self.ota_reply(device):
            return None
        return device

    def in_down_tree(self, template: str) -> bool:
        """Whether a ``{device}`` template lies in the device's ``down/`` tree,
        the only place the packaged ACL lets the device read."""
        return template.startswith(f"{self.prefix}/{{device}}/down/") and template.count("{device}") == 1

    # -- the broker's side ---------------------------------------------------------

    def acl_patterns(self) -> tuple[str, ...]:
        """Mosquitto ACL ``pattern`` lines (``%u``: the device's user name,
        which is also its client id and its topic level)."""
        return (
            f"pattern write {self.prefix}/%u/up/#",
            f"pattern write {self.prefix}/%u/status",
            f"pattern read {self.prefix}/%u/down/#",
        )


DEFAULT: Final = TopicLayout()
