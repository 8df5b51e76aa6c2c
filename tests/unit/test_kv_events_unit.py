"""The kv_events publisher over a real engine thread: a subscriber that reads gets a
snapshot and then deltas that rebuild the rank's digest exactly; one that does not read
is dropped when its queue fills (a DROPPED event ends its stream) while the engine keeps
serving and the reading subscriber sees nothing missing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvstrata import LLM, SamplingParams
from kvstrata.http.kv_event_wire import EventKind, KvEvent
from kvstrata.kvcache.digest_wire import DigestReplica
from kvstrata.runtime.engine_loop import EngineLoop
from kvstrata.server.kv_events import KvEventPublisher, PublisherConfig

CHUNK = 8
TIMEOUT_S = 60


async def _drain(queue: asyncio.Queue[KvEvent | None]) -> list[KvEvent | None]:
    events: list[KvEvent | None] = []
    while not queue.empty():
        events.append(queue.get_nowait())
    return events


def test_a_reader_rebuilds_the_digest_and_a_stalled_one_is_dropped(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=4, num_kv_pages=128)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        engine_loop = EngineLoop(llm.engine)
        engine_loop.start()
        publisher = KvEventPublisher(engine_loop, 0, PublisherConfig(2, load_interval_s=0.01))
        reader = publisher.subscribe(CHUNK)
        stalled = publisher.subscribe(CHUNK)
        replica, events = DigestReplica(), []

        async def read() -> None:
            while (event := await reader.queue.get()) is not None:
                events.append(event)
                if event.digest is not None:
                    assert replica.apply(event.digest), "a delta out of sequence"

        reading = asyncio.create_task(read())
        # Distinct prompts: each one's finish adds new boundaries, so a new version.
        for i in range(6):
            prompt = list(range(50 * (i + 1), 50 * (i + 1) + 17))
            with engine_loop.submit(f"r{i}", [prompt], params) as group:
                outs = await asyncio.wait_for(group.final_outputs(), TIMEOUT_S)
            assert len(outs[0].output_ids) == 2
        want = await engine_loop.call(lambda engine: dict(engine.tiers.digest.entries))
        while replica.entries != want:  # the last change is published after its step
            await asyncio.sleep(0.01)
        publisher.close()
        await asyncio.wait_for(reading, TIMEOUT_S)
        left = await _drain(stalled.queue)
        await engine_loop.stop()

        assert [e.seq for e in events] == list(range(len(events)))
        assert events[0].kind is EventKind.SNAPSHOT
        assert {e.kind for e in events[1:]} <= {EventKind.DELTA, EventKind.LOAD}
        assert len(want) == 6 * 2  # two chunk boundaries per prompt
        # The stalled subscriber: its queue held 2 events, the third dropped it.
        assert [e.kind if e is not None else None for e in left] == [EventKind.DROPPED, None]
        assert stalled not in publisher._subscribers

    asyncio.run(scenario())
