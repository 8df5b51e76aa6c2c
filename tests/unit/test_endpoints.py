"""The typed endpoints (disagg/transport/endpoints.py) and the rank-to-rank schema that
checks them on arrival (disagg/wire.py) name the same fields, and what real receivers
describe their pools with has exactly those fields and passes the schema."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mooncake_fixtures import require_mooncake
from pydantic import BaseModel, TypeAdapter, ValidationError

from kvstrata.disagg import wire
from kvstrata.disagg.transport import endpoints
from kvstrata.disagg.transport.ipc import IpcReceiver, shared_pool_data
from kvstrata.kvcache.pages import KVPool

PAIRS = [
    (endpoints.ShmEndpoint, wire.IpcShmEndpoint),
    (endpoints.CudaIpcEndpoint, wire.IpcCudaEndpoint),
    (endpoints.MooncakeEndpoint, wire.MooncakeEndpoint),
    (endpoints.StagingEndpoint, wire.WireStaging),
]


def keys(typed: Any) -> set[str]:
    return set(typed.__required_keys__) | set(typed.__optional_keys__)


@pytest.mark.parametrize(("typed", "model"), PAIRS, ids=lambda x: x.__name__)
def test_typed_endpoints_and_the_wire_schema_name_the_same_fields(
    typed: Any, model: type[BaseModel]
) -> None:
    assert keys(typed) == set(model.model_fields)
    optional = {name for name, f in model.model_fields.items() if not f.is_required()}
    assert set(typed.__optional_keys__) <= optional


def test_a_shared_memory_receiver_describes_a_valid_shm_endpoint() -> None:
    data, path = shared_pool_data((2, 2, 8, 4, 2, 8), torch.float32)
    receiver = IpcReceiver(KVPool(8, 4, 2, 2, 8, torch.float32, "cpu", data), path)
    try:
        endpoint = receiver.endpoint()
        # All but a tensor-parallel rank's fields (its leader adds them: disagg/tp_transfer.py).
        assert keys(endpoints.ShmEndpoint) - set(endpoint) == {"tp_size", "tp_slices"}
        checked = TypeAdapter(wire.Endpoint).validate_python(endpoint)
        assert isinstance(checked, wire.IpcShmEndpoint)
    finally:
        receiver.close()


@pytest.mark.parametrize("config_json", ["{}", '{"coalesce": false}'], ids=["staging", "none"])
def test_a_mooncake_receiver_describes_a_valid_mooncake_endpoint(config_json: str) -> None:
    require_mooncake()
    from kvstrata.disagg.transport.mooncake import MooncakeReceiver

    receiver = MooncakeReceiver(KVPool(8, 4, 2, 2, 8, torch.float32, "cpu"), config_json)
    try:
        endpoint = receiver.endpoint()
        assert set(endpoint) <= keys(endpoints.MooncakeEndpoint)
        if "staging" in endpoint:
            assert set(endpoint["staging"]) == keys(endpoints.StagingEndpoint)
        checked = TypeAdapter(wire.Endpoint).validate_python(endpoint)
        assert isinstance(checked, wire.MooncakeEndpoint)
    finally:
        receiver.close()


@pytest.mark.parametrize(
    ("change", "field"),
    [({"every_write": "yes"}, "every_write"), ({"every_write": 1}, "every_write"),
     ({"slot_bytes": 0}, "slot_bytes"), ({"extra": True}, "extra")],
)  # fmt: skip
def test_the_wire_schema_refuses_a_bad_staging_field_by_name(
    change: dict[str, Any], field: str
) -> None:
    staging = {"host": "127.0.0.1", "port": 9, "base_ptr": 4096, "slot_bytes": 1 << 20,
               "secret": "ab" * 32, "every_write": False}  # fmt: skip
    endpoint = {"backend": "mooncake", "id": "m-1", "session": "127.0.0.1:9", "base_ptr": 0,
                "shape": [2, 2, 8, 4, 2, 8], "dtype": "torch.float32"}  # fmt: skip
    adapter = TypeAdapter(wire.Endpoint)
    assert isinstance(adapter.validate_python({**endpoint, "staging": staging}),
                      wire.MooncakeEndpoint)  # fmt: skip
    with pytest.raises(ValidationError) as error:
        adapter.validate_python({**endpoint, "staging": {**staging, **change}})
    assert any(field in map(str, e["loc"]) for e in error.value.errors())
