"""Counts the bytes of protobuf messages a servicer receives and sends (evidence of what rides on gRPC)."""

from __future__ import annotations

from google.protobuf.message import Message


class GrpcByteCounter:
    def __init__(self) -> None:
        self.bytes_received = 0
        self.bytes_sent = 0

    def received(self, msg: Message) -> Message:
        self.bytes_received += msg.ByteSize()
        return msg

    def sent(self, msg: Message) -> Message:
        self.bytes_sent += msg.ByteSize()
        return msg
