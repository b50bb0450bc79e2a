"""The return path: commands and desired config from Iggy to devices.

poll.py (Iggy -> inbox), inbox.py (SQLite tables and transactions),
deliver.py (inbox -> MQTT), commands.py (formats and addressing),
legacy.py (reading out the two-topic scheme after an upgrade),
component.py (the runtime component that runs them).
"""

from .commands import Command, CommandState, DesiredConfig, ReturnTopic, return_topic, return_topic_of
from .component import return_path

__all__ = [
    "Command",
    "CommandState",
    "DesiredConfig",
    "ReturnTopic",
    "return_path",
    "return_topic",
    "return_topic_of",
]
