"""Starting a Mooncake Transfer Engine for the `mooncake` transport and registering memory
with it; the engine's transfer status codes."""

from __future__ import annotations

import socket
from typing import Any

import torch

from kvstrata.config.mooncake import FLAG, MooncakeTransportConfig
from kvstrata.disagg.transport.base import TransferError

# transfer_check_status results (mooncake's TransferEnginePy). COMPLETED and FAILED free
# the batch: its id must never be polled again. TIMED_OUT does not free it. Since Mooncake
# 0.3.12 a tcp write is COMPLETED only once applied at the destination.
PENDING, COMPLETED, FAILED, TIMED_OUT = 0, 1, -1, -2


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            "--disaggregation-transfer-backend mooncake needs the Mooncake Transfer Engine: "
            "pip install mooncake-transfer-engine (CUDA) or mooncake-transfer-engine-non-cuda "
            f"(CPU); import failed: {e}"
        ) from e
    return TransferEngine


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def start_engine(config: MooncakeTransportConfig) -> tuple[Any, str]:
    """A started TransferEngine and its session name (what peers address it by). Never
    blocks for long: P2P start-up is local, and the metadata client gives up after ~3 s."""
    engine_class = _engine_class()
    host = config.local_hostname
    for _attempt in range(2):
        engine = engine_class()
        # With P2PHANDSHAKE the engine names itself host:<its rpc port>. A metadata service
        # keys engines by the name given, so two engines of one host need distinct names:
        # a port number free on this host is (a clash is refused; the retry draws anew).
        name = host if config.uses_p2p_handshake else f"{host}:{_unused_port()}"
        rc = engine.initialize(name, config.metadata_server, config.protocol, config.device_name)
        if rc == 0:
            session = f"{host}:{engine.get_rpc_port()}" if config.uses_p2p_handshake else name
            return engine, session
        del engine
    raise TransferError(
        f"the Mooncake transfer engine did not start (status {rc}) with metadata server "
        f"{config.metadata_server!r}, protocol {config.protocol!r} ({FLAG})"
    )


def register(engine: Any, data: torch.Tensor, what: str = "the KV pool") -> int:
    """Registers `data` (one contiguous allocation) with the engine; its base pointer."""
    if not data.is_contiguous():
        raise ValueError(f"the mooncake transport needs {what} contiguous")
    base_ptr, num_bytes = data.data_ptr(), data.numel() * data.element_size()
    rc = engine.register_memory(base_ptr, num_bytes)
    if rc != 0:
        raise TransferError(f"registering {what} ({num_bytes} bytes) failed: status {rc}")
    return base_ptr
