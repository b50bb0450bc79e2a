"""The return path: commands and desired config from Iggy to devices.

poll.py (Iggy -> inbox), inbox.py (SQLite tables and transactions),
deliver.py (inbox -> MQTT), commands.py (formats and addressing),
component.py (the runtime component that runs them).
"""

from .commands import Command, CommandState, DesiredConfig, commands_topic, config_topic
from .component import return_path

__all__ = ["Command", "CommandState", "DesiredConfig", "commands_topic", "config_topic", "return_path"]
