"""The Iggy adapter: uplink, command source, command sink and a diagnostic
probe over the apache-iggy SDK (0.9).

Facts about SDK 0.9.0 / server 0.9.0-edge.5 this package is built on were
read from the sources first and then checked against a real server
(tests/test_uplink_iggy.py holds the real-server tests, marked ``iggy``; they
skip when `iggy-server` is not on PATH).  Each module opens with the facts it
relies on:

==============  ==============================================================
connection.py   one bounded, logged-in client per direction; why SDK
                reconnection and auto-login are off
errors.py       SDK error texts -> UplinkUnavailable / Ambiguous / Rejected
topics.py       partition counts; creating missing topics by the SDK or, for
                servers that refuse its durability keys, by a raw request
send.py         IggyUplink (outbox batches), IggyCommandSink, send_command;
                origin timestamps
source.py       IggyCommandSource (the return path's polls)
offsets.py      the STORE/GET_CONSUMER_OFFSET requests of the offset mirror
wire.py         binary-protocol identifiers and entries those raw requests share
probe.py        IggyProbe: the read-only look `doctor` takes
==============  ==============================================================
"""

from .connection import ClientFactory
from .errors import classify, is_already_exists, is_not_found, is_unsupported_option
from .offsets import (
    GET_CONSUMER_OFFSET_CODE,
    STORE_CONSUMER_OFFSET_CODE,
    decode_consumer_offset,
    encode_get_consumer_offset,
    encode_store_consumer_offset,
)
from .probe import IggyProbe
from .send import IggyCommandSink, IggyUplink, send_command
from .source import IggyCommandSource
from .topics import CREATE_TOPIC_CODE, PERSIST_OPTIONS, encode_create_topic

__all__ = [
    "CREATE_TOPIC_CODE",
    "GET_CONSUMER_OFFSET_CODE",
    "PERSIST_OPTIONS",
    "STORE_CONSUMER_OFFSET_CODE",
    "ClientFactory",
    "IggyCommandSink",
    "IggyCommandSource",
    "IggyProbe",
    "IggyUplink",
    "classify",
    "decode_consumer_offset",
    "encode_create_topic",
    "encode_get_consumer_offset",
    "encode_store_consumer_offset",
    "is_already_exists",
    "is_not_found",
    "is_unsupported_option",
    "send_command",
]
