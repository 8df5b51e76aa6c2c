"""The `mooncake` KV transport on the real Mooncake Transfer Engine (tcp, loopback): pages
land byte-exact in another process's pool, PD through it equals unified serving, a dead
or frozen decode rank fails a write in bounded time and delays no write to another one,
and config errors name the flag."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from mooncake_fixtures import MooncakeMaster, require_mooncake
from test_pd_engine import GREEDY, PAGE, assert_idle, serve_pd

from kvstrata import LLM
from kvstrata.config.mooncake import FLAG, MooncakeTransportConfig
from kvstrata.disagg.transport.base import TransferError
from kvstrata.disagg.transport.mooncake import MooncakeReceiver, MooncakeSender
from kvstrata.disagg.transport.mooncake_plan import PoolRegion, Transfer, plan_transfers
from kvstrata.kvcache.pages import KVPool

LAYOUT = {"page_size": 4, "num_layers": 3, "num_kv_heads": 2, "head_dim": 8}
SENTINEL = -7.0  # receiver pools start filled with it: pages not written must keep it
P2P = json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "timeout_s": 2.0})
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16)}


@pytest.fixture
def mooncake_installed() -> None:
    """Tests that start engines need Mooncake: its absence fails them (see require_mooncake)."""
    require_mooncake()


def make_pool(num_pages: int, dtype: torch.dtype, seed: int | None = None) -> KVPool:
    """A pool of random pages (seed given) or of SENTINEL."""
    pool = KVPool(num_pages, dtype=dtype, device="cpu", **LAYOUT)
    if seed is None:
        pool.data.fill_(SENTINEL)
    else:
        generator = torch.Generator().manual_seed(seed)
        pool.data.copy_(torch.randn(pool.data.shape, generator=generator))
    return pool


def as_bytes(data: torch.Tensor) -> torch.Tensor:
    return data.contiguous().view(torch.uint8)


def expected_pool(
    src: KVPool, num_pages: int, writes: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    expected = make_pool(num_pages, src.data.dtype).data
    for src_page_ids, dst_page_ids in writes:
        expected[:, :, dst_page_ids] = src.data[:, :, src_page_ids]
    return expected


# ---- a decode rank in another process ---------------------------------------------------


def _receiver_main(conn: Connection, num_pages: int, dtype_name: str, config_json: str) -> None:
    """Child process: owns a receiver; answers "dump" with its pool's bytes."""
    pool = make_pool(num_pages, DTYPES[dtype_name])
    receiver = MooncakeReceiver(pool, config_json)
    conn.send(receiver.endpoint())
    while conn.recv() == "dump":
        conn.send(as_bytes(pool.data).numpy().tobytes())
    receiver.close()


class ReceiverProcess:
    """A receiver in a spawned process (never fork: torch has run in this one)."""

    def __init__(self, num_pages: int, dtype: torch.dtype, config_json: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.shape = (LAYOUT["num_layers"], 2, num_pages, LAYOUT["page_size"],
                      LAYOUT["num_kv_heads"], LAYOUT["head_dim"])  # fmt: skip
        self.dtype = dtype
        self.process = context.Process(
            target=_receiver_main,
            args=(child_conn, num_pages, str(dtype), config_json),
            daemon=True,
        )
        self.process.start()
        self._endpoint: dict[str, Any] | None = None

    def endpoint(self) -> dict[str, Any]:
        if self._endpoint is None:
            assert self.conn.poll(60), "the receiver process did not start"
            # It crosses processes as JSON does between ranks.
            self._endpoint = json.loads(json.dumps(self.conn.recv()))
        return self._endpoint

    def dump(self) -> torch.Tensor:
        self.conn.send("dump")
        assert self.conn.poll(30), "the receiver process did not answer"
        raw = bytearray(self.conn.recv())
        return torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype).view(self.shape)

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)
        if signum == signal.SIGSTOP:  # delivered asynchronously: wait until every thread stops
            status = Path(f"/proc/{self.process.pid}/status")
            deadline_s = time.monotonic() + 10
            while "\tT" not in next(line for line in status.read_text().splitlines()
                                     if line.startswith("State:")):  # fmt: skip
                assert time.monotonic() < deadline_s, "the receiver process did not stop"
                time.sleep(0.001)

    def kill(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGCONT)
            self.process.kill()
        self.process.join(10)


@pytest.mark.usefixtures("mooncake_installed")
@pytest.mark.parametrize(
    ("metadata", "dtype"),
    [("p2p", torch.float32), ("http", torch.bfloat16), ("p2p-plain", torch.float32),
     ("p2p-host-staging", torch.float32)],
    ids=["p2p-handshake-float32", "http-metadata-bfloat16", "every-run-its-transfer-float32",
         "every-write-through-staging-float32"],
)  # fmt: skip
def test_pages_land_byte_exact_in_another_process(
    metadata: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    config_json = P2P  # no metadata service: peers exchange descriptors directly
    if metadata == "http":  # the HTTP metadata service of a real mooncake_master
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        config_json = json.dumps({"metadata_server": master.metadata_server, "timeout_s": 2.0})
    if metadata == "p2p-plain":  # every run of pages its own transfer, polled
        config_json = json.dumps({**json.loads(P2P), "coalesce": False})
    if metadata == "p2p-host-staging":  # even consecutive pages go through staging
        config_json = json.dumps({**json.loads(P2P), "host_staging": True})
    src = make_pool(128, dtype, seed=1)
    receiver = ReceiverProcess(160, dtype, config_json)  # page counts may differ
    sender = MooncakeSender(src, config_json)
    try:
        endpoint = receiver.endpoint()
        assert endpoint["backend"] == "mooncake"
        writes = [
            ([5, 9, 0, 17], [100, 3, 159, 42]),  # scattered, both ends of the pool
            ([20, 21, 22, 23, 40], [50, 51, 52, 53, 7]),  # a run of four, then one
            # 64 scattered pages = 384 transfers: more than the in-flight window
            (list(range(64, 128)), list(range(159, 31, -2))),
        ]
        for src_page_ids, dst_page_ids in writes:
            sender.write(endpoint, src_page_ids, dst_page_ids)
        expected = expected_pool(src, 160, writes)
        assert torch.equal(as_bytes(receiver.dump()), as_bytes(expected))
        if metadata == "p2p-host-staging":
            assert sender.num_writes == {"coalesced": len(writes), "plain": 0}
    finally:
        sender.close()
        receiver.kill()


# ---- PD through the transport ------------------------------------------------------------


@pytest.mark.usefixtures("mooncake_installed")
@pytest.mark.parametrize(
    "decode_flags",
    [{}, {"disaggregation_decode_enable_radix_cache": True}],
    ids=["no-decode-cache", "decode-L1"],
)
def test_multi_turn_pd_over_mooncake_equals_unified(tiny_llama: Path, decode_flags: dict) -> None:
    # Prefill and decode engines share this process: Mooncake allows several engines.
    small = {"page_size": PAGE, "num_kv_pages": 256}  # a default-sized pool costs seconds
    mooncake = {
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_mooncake_config": P2P,
    }
    prefill = LLM(str(tiny_llama), disaggregation_mode="prefill", **small, **mooncake).engine
    decode = LLM(
        str(tiny_llama), disaggregation_mode="decode", **small, **mooncake, **decode_flags,
        disaggregation_decode_local_prefill="never",
    ).engine  # fmt: skip
    unified = LLM(str(tiny_llama), disable_radix_cache=True, **small)
    assert decode.role.receiver.endpoint()["backend"] == "mooncake"
    history: list[int] = []
    for turn in range(3):
        history = history + [(37 * turn + 11 * i) % 500 for i in range(13)]
        out = serve_pd(prefill, decode, history)
        (want,) = unified.generate(input_ids=[history], sampling_params=GREEDY)
        assert out.output_ids == want.output_ids
        assert out.cache_usage.transferred_tokens > 0
        history = history + out.output_ids
    assert_idle(prefill)
    assert_idle(decode)


# ---- failures ---------------------------------------------------------------------------


def write_checked(sender: MooncakeSender, receiver: MooncakeReceiver, src: KVPool) -> None:
    """A write to a healthy in-process receiver lands."""
    before = receiver.pool.data.clone()
    sender.write(receiver.endpoint(), [1, 2, 7], [30, 31, 4])
    before[:, :, [30, 31, 4]] = src.data[:, :, [1, 2, 7]]
    assert torch.equal(receiver.pool.data, before)


@pytest.mark.usefixtures("mooncake_installed")
def test_dead_or_frozen_receiver_fails_in_bounded_time() -> None:
    timeout_s = 1.0
    config_json = json.dumps({"timeout_s": timeout_s})
    src = make_pool(16, torch.float32, seed=2)
    healthy = MooncakeReceiver(make_pool(32, torch.float32), config_json)
    frozen, killed, never_contacted = (
        ReceiverProcess(32, torch.float32, config_json) for _ in range(3)
    )
    sender = MooncakeSender(src, config_json)
    try:
        for peer in (frozen, killed):
            sender.write(peer.endpoint(), [0, 1], [0, 1])

        # Frozen after first contact (SIGSTOP: its sockets stay open, nobody answers).
        frozen.signal(signal.SIGSTOP)
        start_s = time.monotonic()
        with pytest.raises(TransferError, match="no transfer finished"):
            sender.write(frozen.endpoint(), [2, 3, 4], [2, 3, 9])
        assert time.monotonic() - start_s < timeout_s + 2.0
        write_checked(sender, healthy, src)

        # Gone after first contact: the engine fails its transfers after one reconnect
        # round (about 1 s), unless timeout_s comes first.
        killed.kill()
        start_s = time.monotonic()
        with pytest.raises(TransferError, match=r"failed|no transfer finished"):
            sender.write(killed.endpoint(), [5], [5])
        assert time.monotonic() - start_s < timeout_s + 2.0
        with pytest.raises(TransferError, match="unreachable"):  # probed again: refused
            sender.write(killed.endpoint(), [5], [5])
        write_checked(sender, healthy, src)

        # Frozen before any contact: the first contact is bounded too and does not stall
        # writes to other peers (the engine itself would wait about a minute).
        never_contacted.signal(signal.SIGSTOP)
        start_s = time.monotonic()
        with pytest.raises(TransferError, match="did not answer"):
            sender.write(never_contacted.endpoint(), [0], [0])
        assert time.monotonic() - start_s < timeout_s + 2.0
        write_checked(sender, healthy, src)
    finally:
        for peer in (frozen, killed, never_contacted):
            peer.kill()
        sender.close()
        healthy.close()


@pytest.mark.usefixtures("mooncake_installed")
def test_a_stopped_receiver_delays_no_write_to_another() -> None:
    """Writes start without waiting on their peer; one into a stopped receiver stays in
    flight (its timeout is far off) while writes to a healthy receiver land, and it lands
    byte-exact once the receiver resumes."""
    config_json = json.dumps({"timeout_s": 60.0})
    src = make_pool(16, torch.float32, seed=5)
    healthy = MooncakeReceiver(make_pool(32, torch.float32), config_json)
    stopped = ReceiverProcess(32, torch.float32, config_json)
    sender = MooncakeSender(src, config_json)
    try:
        sender.write(stopped.endpoint(), [0], [0])  # first contact while it answers
        stopped.signal(signal.SIGSTOP)
        stuck = sender.start(stopped.endpoint(), [2, 3, 4], [2, 3, 9])
        assert not stuck.poll()
        for _ in range(3):
            write_checked(sender, healthy, src)
        assert not stuck.poll()  # still in flight, not given up
        stopped.signal(signal.SIGCONT)
        deadline_s = time.monotonic() + 50
        while not stuck.poll():
            assert time.monotonic() < deadline_s, "the write never landed after the resume"
            time.sleep(0.01)
        expected = expected_pool(src, 32, [([0], [0]), ([2, 3, 4], [2, 3, 9])])
        assert torch.equal(stopped.dump(), expected)
    finally:
        stopped.kill()
        sender.close()
        healthy.close()


@pytest.mark.usefixtures("mooncake_installed")
def test_closed_ends_fail_cleanly() -> None:
    src = make_pool(8, torch.float32, seed=3)
    receiver = MooncakeReceiver(make_pool(8, torch.float32), P2P)
    sender = MooncakeSender(src, P2P)
    endpoint = receiver.endpoint()
    sender.write(endpoint, [0], [0])
    receiver.close()
    receiver.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        receiver.endpoint()
    with pytest.raises(TransferError):  # its memory is unregistered: the write is refused
        sender.write(endpoint, [1], [1])
    sender.close()
    sender.close()
    with pytest.raises(TransferError, match="closed"):
        sender.write(endpoint, [1], [1])


@pytest.mark.usefixtures("mooncake_installed")
def test_bad_writes_are_refused_before_any_transfer() -> None:
    src = make_pool(8, torch.float32, seed=4)
    receiver = MooncakeReceiver(make_pool(12, torch.float32), P2P)
    sender = MooncakeSender(src, P2P)
    endpoint = receiver.endpoint()
    other_dtype = {**endpoint, "id": "x1", "dtype": "torch.bfloat16"}
    other_shape = {**endpoint, "id": "x2", "shape": [3, 2, 12, 4, 2, 16]}
    bad = [
        ({"backend": "ipc", "id": "x0"}, [0], [0], "not a mooncake endpoint"),
        ({"backend": "mooncake", "id": "x3"}, [0], [0], "malformed"),
        (other_dtype, [0], [0], "dtype"),
        (other_shape, [0], [0], "shape"),
        (endpoint, [0, 1], [0], "source pages for"),
        (endpoint, [0], [12], "outside the remote pool"),
        (endpoint, [8], [0], "outside the local pool"),
        (endpoint, [0, 1], [3, 3], "repeat"),
    ]
    try:
        for bad_endpoint, src_page_ids, dst_page_ids, message in bad:
            with pytest.raises(TransferError, match=message):
                sender.write(bad_endpoint, src_page_ids, dst_page_ids)
        assert torch.all(receiver.pool.data == SENTINEL)
        sender.write(endpoint, [], [])
    finally:
        sender.close()
        receiver.close()


# ---- planning and config -----------------------------------------------------------------


def test_plan_coalesces_runs_of_consecutive_pages_per_layer_and_kv() -> None:
    # 4 planes (2 layers, K and V) of 16-byte pages; 10 pages here, 20 remote.
    src, dst = PoolRegion(1000, 10, 4, 16), PoolRegion(50_000, 20, 4, 16)
    transfers = plan_transfers(src, dst, [3, 4, 5, 8, 1], [7, 8, 9, 2, 6])
    # Sorted by source page: 1->6 alone, 3..5->7..9 one run, 8->2 alone; in every plane.
    runs = [(1, 6, 1), (3, 7, 3), (8, 2, 1)]
    assert transfers == [
        Transfer(1000 + (plane * 10 + s) * 16, 50_000 + (plane * 20 + d) * 16, n * 16)
        for plane in range(4)
        for s, d, n in runs
    ]
    assert PoolRegion.of(make_pool(10, torch.float32).data).num_planes == 2 * 3


def test_plan_splits_long_runs() -> None:
    chunk_bytes = 3 << 20  # two pages: 6 MiB, cut into 4 MiB + 2 MiB
    src, dst = PoolRegion(0, 4, 1, chunk_bytes), PoolRegion(0, 4, 1, chunk_bytes)
    transfers = plan_transfers(src, dst, [0, 1], [2, 3])
    assert transfers == [
        Transfer(0, 2 * chunk_bytes, 4 << 20),
        Transfer(4 << 20, 2 * chunk_bytes + (4 << 20), 2 << 20),
    ]


@pytest.mark.parametrize(
    ("config_json", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"metadata": "P2PHANDSHAKE"}', "unknown key"),
        ('{"protocol": "udp"}', "protocol"),
        ('{"timeout_s": 0}', "timeout_s"),
        ('{"timeout_s": "5"}', "timeout_s must be a float"),
        ('{"local_hostname": "127.0.0.1:17000"}', "without a port"),
        ('{"metadata_server": ""}', "metadata_server"),
        ('{"coalesce": 1}', "coalesce must be a bool"),
        ('{"staging_slots": true}', "staging_slots must be a int"),
        ('{"staging_slots": 0}', "staging_slots must be at least 1"),
        ('{"staging_slot_bytes": 1024}', "staging_slot_bytes must be at least"),
        ('{"host_staging": true, "coalesce": false}', "host_staging needs coalesce"),
        ('{"host_staging": "always"}', "host_staging must be auto, on or off"),
        ('{"host_staging": 1}', "host_staging must be a str"),
    ],
)
def test_config_errors_name_the_flag(config_json: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        MooncakeTransportConfig.from_json(config_json)
    assert FLAG in str(error.value)
    with pytest.raises(ValueError, match=FLAG):
        MooncakeSender(make_pool(2, torch.float32), config_json)


def test_config_defaults_need_no_metadata_service() -> None:
    config = MooncakeTransportConfig.from_json("{}")
    assert config.uses_p2p_handshake and config.protocol == "tcp"
    assert MooncakeTransportConfig.from_json('{"timeout_s": 3}').timeout_s == 3


@pytest.mark.parametrize(
    ("options", "on_cuda", "on_cpu"),
    [
        ({}, True, False),  # auto: tcp with a GPU pool
        ({"protocol": "rdma"}, False, False),  # the NIC reads GPU memory itself
        ({"coalesce": False}, False, False),  # no staging at all
        ({"host_staging": True}, True, True),
        ({"host_staging": "on"}, True, True),
        ({"host_staging": False}, False, False),
        ({"host_staging": "off"}, False, False),
    ],
)
def test_host_staging_follows_protocol_and_pool(
    options: dict[str, Any], on_cuda: bool, on_cpu: bool
) -> None:
    config = MooncakeTransportConfig.from_json(json.dumps(options))
    assert config.host_staging_for(True) is on_cuda
    assert config.host_staging_for(False) is on_cpu


def test_engine_start_refuses_a_bad_mooncake_config(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=FLAG):
        LLM(
            str(tiny_llama), page_size=PAGE, num_kv_pages=16, disaggregation_mode="prefill",
            disaggregation_transfer_backend="mooncake",
            disaggregation_mooncake_config='{"protocl": "tcp"}',
        )  # fmt: skip
