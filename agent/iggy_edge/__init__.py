"""iggy-edge: MQTT devices -> durable SQLite store-and-forward -> Apache Iggy."""

__version__ = "0.1.0"
