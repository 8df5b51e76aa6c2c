"""The seam between the engine and a rank's role (unified, prefill or decode): the hooks
the engine calls each step (`Role`), the engine services a role may ask for
(`EngineServices`), what a role is built from, and the unified role itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvstrata.config import ConfigError, EngineConfig
from kvstrata.core import (
    Batch,
    ErrorKind,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)

if TYPE_CHECKING:
    import torch

    from kvstrata.engine.kv_manager import RequestKV
    from kvstrata.engine.scheduler import Scheduler
    from kvstrata.engine.tp_transfer import TPTransfers, WorkerTransfer
    from kvstrata.kvcache.pages import KVPool


class EngineServices(Protocol):
    """What a role may ask of its engine, on the engine thread only."""

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None
    ) -> Request:
        """Queue a request (through the role's `add`); raises ValueError for bad input."""
        ...

    def commit_token(
        self, req: Request, token_id: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Record a token of `req` whose KV up to it is computed (with its `logprobs`,
        when it was sampled elsewhere); stop it if done."""
        ...

    def fail_request(
        self, req: Request, message: str, kind: ErrorKind = ErrorKind.UNAVAILABLE
    ) -> RequestOutput:
        """End `req` (an abort) and return its final output carrying `message` (of `kind`:
        by default another rank may serve the request)."""
        ...


class Role(Protocol):
    """How requests enter and leave the engine. The engine calls these hooks and never
    branches on the mode; a role's own commands (rooms, transfers) are its business."""

    @property
    def num_unfinished(self) -> int:
        """Requests held here, outside the scheduler."""
        ...

    def add(self, req: Request) -> None:
        """Take a new request."""
        ...

    def before_step(self) -> None:
        """Run once per engine step, before scheduling."""
        ...

    def before_forward(self, batch: Batch) -> None:
        """`batch` is scheduled and its pages are granted; its forward is launched next."""
        ...

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        """A scheduler-held request finished (for `reason`) and still holds its pages.
        True: the role keeps them and releases them itself later (its `num_unfinished`
        counts the request meanwhile)."""
        ...

    def holds(self, req: Request) -> bool: ...

    def drop(self, req: Request) -> None:
        """Release a request this role holds (abort or failure)."""
        ...

    def close(self) -> None:
        """Release transport resources at shutdown."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters for /metrics (name -> value), e.g. bytes sent by PD transfer."""
        ...

    def take_expired(self) -> list[Request]:
        """Held requests that waited too long to be let in; the engine fails them."""
        ...

    def observe_step(self, batch: Batch, step_s: float) -> None:
        """`batch` ran in `step_s` seconds, measured up to its sampled tokens on the host."""
        ...

    @property
    def max_local_prefill_tokens(self) -> int:
        """Decode: the most uncached prompt tokens this rank would now compute itself
        instead of asking a prefill rank (0 elsewhere)."""
        ...

    @property
    def choices_share_prompt(self) -> bool:
        """Whether a prompt's choices 1.. wait for choice 0's prompt pages (unified) or
        each computes or receives its own (a prefill task or decode room per choice)."""
        ...

    def held_requests(self) -> list[tuple[str, Request]]:
        """(place, request) for every live request held here, outside the scheduler."""
        ...

    def page_holders(self) -> list[Request]:
        """Requests (or stand-ins) holding L1 pages outside the scheduler's running list."""
        ...

    def ended_holders(self) -> dict[str, Request]:
        """Of `page_holders`, those whose request ended or moved on (stand-ins, senders),
        by a label naming them: none of them may be a live request."""
        ...

    @property
    def counts(self) -> dict[str, int]:
        """This role's in-flight counts for the invariants report, by name."""
        ...

    def check_integrity(self) -> list[str]:
        """Violations of this role's own invariants, each naming the role."""
        ...


@dataclass(frozen=True)
class RoleParts:
    """What a role is built from: the engine's config, KV manager, scheduler and pool."""

    config: EngineConfig
    kv: RequestKV
    scheduler: Scheduler
    pool: KVPool
    shm_path: Path | None  # the pool's shared-memory file, if it has one
    num_params: int  # the model's, for a decode rank's local prefill costs
    max_model_len: int
    vocab_size: int
    tp: TPTransfers | None = None  # a tensor-parallel rank's followers' transfer ends


class RoleFactory(Protocol):
    """Chooses a rank's role from its config (and where its L1 pool lives)."""

    def pool_storage(
        self,
        config: EngineConfig,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor | None, Path | None]:
        """Storage for the L1 pool (None: a private allocation) and its shared file."""
        ...

    def make_role(self, parts: RoleParts, services: EngineServices) -> Role: ...

    def worker_transfer(
        self, config: EngineConfig, pool: KVPool, shm_path: Path | None
    ) -> WorkerTransfer | None:
        """A tensor-parallel follower's end of the rank's transport over its own slice of
        the pool (None: the rank transfers nothing)."""
        ...


class SchedulerEntry:
    """Requests go straight to the scheduler; nothing is held outside it. The unified
    role, and the entry half of the prefill role."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    @property
    def num_unfinished(self) -> int:
        return 0

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def before_step(self) -> None:
        pass

    def before_forward(self, batch: Batch) -> None:
        pass

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        return False

    def holds(self, req: Request) -> bool:
        return False

    def drop(self, req: Request) -> None:
        raise RuntimeError(f"request {req.rid} is not held outside the scheduler")

    def close(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def take_expired(self) -> list[Request]:
        return []

    def observe_step(self, batch: Batch, step_s: float) -> None:
        pass

    @property
    def max_local_prefill_tokens(self) -> int:
        return 0

    @property
    def choices_share_prompt(self) -> bool:
        return True

    def held_requests(self) -> list[tuple[str, Request]]:
        return []

    def page_holders(self) -> list[Request]:
        return []

    def ended_holders(self) -> dict[str, Request]:
        return {}

    @property
    def counts(self) -> dict[str, int]:
        return {}

    def check_integrity(self) -> list[str]:
        return []


class UnifiedRoles:
    """The role factory of an engine that is not one side of a PD pair (the default)."""

    def pool_storage(
        self,
        config: EngineConfig,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor | None, Path | None]:
        return None, None

    def make_role(self, parts: RoleParts, services: EngineServices) -> Role:
        mode = parts.config.pd.mode
        if mode != "null":
            raise ConfigError(
                f"--disaggregation-mode {mode} needs the PD roles: build the engine with "
                f"kvstrata.disagg.factory.PD_ROLES (kvstrata serve and LLM do)"
            )
        return SchedulerEntry(parts.scheduler)

    def worker_transfer(
        self, config: EngineConfig, pool: KVPool, shm_path: Path | None
    ) -> WorkerTransfer | None:
        return None


UNIFIED_ROLES = UnifiedRoles()
