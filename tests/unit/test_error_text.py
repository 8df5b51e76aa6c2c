"""Error messages always say what failed (kvstrata/errors_text.py): an exception with an
empty `str()` (httpx timeouts) is named with its type, the timeout and the URL, and a
prefill rank that stops answering fails the room with text after the colon."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.rooms import Attempts, SentRoom
from kvstrata.disagg.transport.base import TransferError
from kvstrata.errors_text import describe_error
from kvstrata.pd.decode_sender import DecodeRoomSender


def test_a_message_is_kept_and_qualified_on_request() -> None:
    assert describe_error(ValueError("bad token id 7")) == "bad token id 7"
    assert describe_error(ValueError("bad"), qualified=True) == "ValueError: bad"


def test_an_empty_message_falls_back_to_the_type_and_its_cause() -> None:
    assert describe_error(TimeoutError()) == "TimeoutError"
    assert describe_error(httpx.ReadTimeout("")) == "ReadTimeout"  # no request attached
    try:
        try:
            raise KeyError("room-7")
        except KeyError as inner:
            raise TransferError() from inner
    except TransferError as e:
        assert describe_error(e) == "TransferError (caused by 'room-7')"


def test_an_httpx_timeout_names_the_timeout_and_the_url() -> None:
    request = httpx.Request("POST", "http://127.0.0.1:9/pd/prefill")
    request.extensions["timeout"] = {"connect": 5.0, "read": 30.0, "write": 5.0, "pool": 5.0}
    assert str(httpx.ReadTimeout("", request=request)) == ""  # the defect's cause
    assert (
        describe_error(httpx.ReadTimeout("", request=request))
        == "ReadTimeout after 30 s talking to http://127.0.0.1:9/pd/prefill"
    )
    assert describe_error(httpx.ConnectTimeout("", request=request), qualified=True) == (
        "ConnectTimeout after 5 s talking to http://127.0.0.1:9/pd/prefill"
    )
    assert describe_error(httpx.RemoteProtocolError("", request=request)) == (
        "RemoteProtocolError talking to http://127.0.0.1:9/pd/prefill"
    )


class FailureRecorder:
    """The engine side the dispatcher reports to: the failure message of each room."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}

    def fail_room(self, rid: str, message: str, kind: object = None) -> None:
        self.failed[rid] = message

    def release_room(self, rid: str) -> bool:
        return True


class FakeLoop:
    def __init__(self) -> None:
        self.engine = FailureRecorder()

    async def run(self, command: Callable[..., Any], *args: Any) -> Any:
        return command(*args)

    async def run_output(self, command: Callable[..., Any], *args: Any) -> None:
        command(*args)


def test_a_prefill_rank_that_stops_answering_fails_the_room_with_a_message() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)  # takes the request, as a paused rank's socket does
        await asyncio.sleep(10)
        writer.close()

    async def main() -> str:
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = FakeLoop()
        dispatcher = DecodeRoomSender(loop, loop.engine, timeout_s=0.3)  # type: ignore[arg-type]
        task = PrefillTask("r1", [1, 2, 3], 0, [0], {"backend": "ipc"})
        dispatcher.send([SentRoom("r1", f"http://127.0.0.1:{port}", task, Attempts())])
        for _ in range(200):
            if loop.engine.failed:
                break
            await asyncio.sleep(0.02)
        await dispatcher.close()
        server.close()
        return loop.engine.failed["r1"]

    message = asyncio.run(main())
    prefix = "prefill for this request failed: "
    assert message.startswith(prefix)
    assert message[len(prefix) :].startswith("ReadTimeout after 0.3 s talking to http://127.0.0.1:")
    assert message.endswith("/pd/prefill")
