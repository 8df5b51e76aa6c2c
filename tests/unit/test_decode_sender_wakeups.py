"""A decode rank's engine thread wakes the event loop only when it has something to say: a
real decode engine, its real `EngineLoop` and `DecodeRoomSender`, and a prefill rank that
takes the room and never answers. The room going out is one post; the idle steps that
follow while the transfer is awaited post nothing; the client leaving is one more post,
which settles the room (aborted there, its pages released)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata import LLM, SamplingParams
from kvstrata.engine.invariants import check_engine
from kvstrata.pd.decode_sender import DecodeRoomSender
from kvstrata.runtime.engine_loop import EngineLoop

NUM_IDLE_STEPS = 40


async def prefill_that_never_answers(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Takes /pd/prefill and stays silent; confirms /pd/abort."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"POST /pd/abort"):
        await asyncio.sleep(3600)
    match = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    await reader.readexactly(int(match.group(1)) if match else 0)
    body = b'{"aborted": false}'
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    writer.close()


async def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(12_000):  # behaviour, not timing: the engine thread moves it along
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_an_idle_decode_rank_posts_nothing_per_step(tiny_llama: Path) -> None:
    engine = LLM(
        str(tiny_llama), page_size=4, disaggregation_mode="decode", num_kv_pages=64,
        disaggregation_decode_local_prefill="never",
    ).engine  # fmt: skip
    posts: list[str] = []
    num_steps = [0]

    async def main() -> dict[str, Any]:
        server = await asyncio.start_server(prefill_that_never_answers, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        loop = EngineLoop(engine)
        sender = DecodeRoomSender(loop, engine.role, timeout_s=600, answer_timeout_s=600)  # type: ignore[arg-type]
        engine.role.send_to(sender)  # type: ignore[attr-defined]
        post, step = loop._post, engine.step

        def counted_post(fn: Callable[..., None], *args: Any) -> None:
            posts.append(getattr(fn, "__name__", repr(fn)))
            post(fn, *args)

        def counted_step() -> Any:
            num_steps[0] += 1
            return step()

        loop._post = counted_post  # type: ignore[method-assign]
        engine.step = counted_step  # type: ignore[method-assign]
        loop.start()
        group = sender.submit("r", [list(range(1, 30))], SamplingParams(max_tokens=4), url)
        await wait_until(lambda: sender.counts["dispatcher_targets"] == 1)  # the room is out
        sent = list(posts)
        first_idle_step = num_steps[0]
        await wait_until(lambda: num_steps[0] >= first_idle_step + NUM_IDLE_STEPS)
        idle = posts[len(sent) :]
        group.close()  # the client leaves
        await wait_until(
            lambda: not engine.has_unfinished and not sender.counts["dispatcher_active"]
        )
        report = await loop.call(check_engine)
        await loop.stop()
        await sender.close()
        server.close()
        return {"sent": sent, "idle": idle, "left": posts[len(sent) :], "report": report}

    seen = asyncio.run(main())
    assert seen["sent"] == ["send"]  # one wake-up: the room was SENT
    assert seen["idle"] == []  # NUM_IDLE_STEPS steps waiting for the transfer: no post
    # The client left: stop sending and settle the room; its final output to its group.
    assert seen["left"] == ["stop", "_deliver_all"]
    report = seen["report"]
    assert report.ok and report.idle, report.to_json()
    assert engine.role.metrics()["pd_zombie_rooms"] == 0  # released once the abort was confirmed
