"""`Secret`: how a config holds a key once it is resolved, so that nothing that shows the
config shows the key: its repr and str, `dataclasses.asdict` (what /server_info lists
of the engine config: `{"is_set": true}`) and any JSON made from that."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field


@dataclass(frozen=True, init=False, repr=False, eq=False)
class Secret:
    """A key. Its one dataclass field says only that it is set; the value is an attribute
    outside the fields, read by `reveal()` where the key is used, and nowhere else."""

    is_set: bool = field(default=True, init=False)

    def __init__(self, value: str) -> None:
        object.__setattr__(self, "_value", value)

    def reveal(self) -> str:
        value: str = self.__dict__["_value"]
        return value

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Secret):
            other = other.reveal()
        return isinstance(other, str) and hmac.compare_digest(
            self.reveal().encode(), other.encode()
        )

    def __hash__(self) -> int:
        return hash(self.reveal())
