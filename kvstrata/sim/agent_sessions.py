"""The agentic workload's vocabulary, shared by `kvstrata bench` and `kvstrata simulate`:
sessions of tool-calling turns, each turn a prompt (tokens appended to the session's
context, or a trace's whole prompt as blocks), a pause before it, and the sub-agent
sessions it spawns. Built by agent_synth.py (synthetic) and agent_trace.py (public traces)."""

from __future__ import annotations

from dataclasses import dataclass

# The pause-length buckets the reports split resumed turns' TTFT by: (label, upper bound s).
PAUSE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1 s", 1.0),
    ("1-10 s", 10.0),
    ("10-60 s", 60.0),
    ("1-10 min", 600.0),
    (">10 min", float("inf")),
)


def pause_bucket(pause_s: float) -> str:
    """The label of the bucket `pause_s` falls in (upper bounds exclusive)."""
    for label, upper_s in PAUSE_BUCKETS:
        if pause_s < upper_s:
            return label
    return PAUSE_BUCKETS[-1][0]


@dataclass(frozen=True)
class Appended:
    """Synthetic turns: `num_tokens` new tokens (a tool result, a user message, a
    sub-agent's task) appended to the session's context; the answer is appended after."""

    num_tokens: int


@dataclass(frozen=True)
class Blocks:
    """Trace turns: the whole prompt, `input_len` tokens cut from blocks of the workload's
    `block_len` tokens named by `block_ids` (equal ids: equal tokens, so a trace's prefix
    sharing is the prompts' prefix sharing). Answers are not carried into the next prompt:
    the trace says what it holds."""

    block_ids: tuple[int, ...]
    input_len: int


TurnPrompt = Appended | Blocks


@dataclass(frozen=True)
class AgentTurn:
    """One request of a session. `pause_s`: from the end of the session's previous turn
    (and the return of the sub-agents it waits for) to this request; for a sub-agent's
    first turn, from the parent's spawning answer. `children`: the sessions (indices into
    the workload) this turn's answer spawns."""

    prompt: TurnPrompt
    output_len: int
    pause_s: float
    children: tuple[int, ...] = ()


@dataclass(frozen=True)
class AgentSession:
    """An agent's chain of turns. A root session's first prompt starts with its kind's
    system/tool prefix (synthetic) and arrives at `start_s`; a sub-agent (`parent` set)
    starts from its parent's whole context at the spawning turn. The last turn closes it
    (sent with `X-Session-Final: true`)."""

    index: int
    session_id: str
    kind: int  # agent kind: the sessions of one kind share the system/tool prefix
    turns: tuple[AgentTurn, ...]
    parent: int | None = None
    start_s: float = 0.0  # root sessions: arrival after the run's start
    joins_parent: bool = True  # the parent's next turn waits for this sub-agent to end

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True)
class AgentWorkload:
    """Sessions in index order (a child after its parent). Synthetic workloads give
    `prefix_lens` (tokens of each kind's system/tool prefix); trace workloads `block_len`."""

    name: str
    sessions: tuple[AgentSession, ...]
    prefix_lens: tuple[int, ...] = ()
    block_len: int = 0

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def roots(self) -> list[AgentSession]:
        return [s for s in self.sessions if s.is_root]

    def check(self) -> None:
        """ValueError naming the first broken rule: indices in order, children after
        their parent and listed by exactly one turn of it, kinds with a prefix, block
        prompts only with a block length, at least one turn per session."""
        spawned: dict[int, int] = {}
        for position, session in enumerate(self.sessions):
            if session.index != position:
                raise ValueError(
                    f"session {session.session_id}: index {session.index} != {position}"
                )
            if not session.turns:
                raise ValueError(f"session {session.session_id} has no turns")
            for turn in session.turns:
                if isinstance(turn.prompt, Blocks) and self.block_len < 1:
                    raise ValueError("a block prompt needs the workload's block_len")
                for child in turn.children:
                    if child <= position or child in spawned:
                        raise ValueError(f"session {child}: spawned twice or before its parent")
                    spawned[child] = position
            if session.parent is not None and spawned.get(position) != session.parent:
                raise ValueError(f"session {session.session_id}: not spawned by its parent")
            if session.is_root and self.prefix_lens and session.kind >= len(self.prefix_lens):
                raise ValueError(f"session {session.session_id}: kind {session.kind} has no prefix")

    def distinct_tokens_bound(self) -> int:
        """At most this many distinct tokens can ever be cached (prefixes, appended
        tokens, answers, trace blocks and the tails past them): an infinite cache's size."""
        num_tokens = sum(self.prefix_lens)
        block_ids: set[int] = set()
        for session in self.sessions:
            for turn in session.turns:
                num_tokens += turn.output_len
                if isinstance(turn.prompt, Appended):
                    num_tokens += turn.prompt.num_tokens
                else:
                    block_ids.update(turn.prompt.block_ids)
                    num_tokens += max(0, turn.prompt.input_len - self.block_tokens(turn.prompt))
        return num_tokens + len(block_ids) * self.block_len

    def block_tokens(self, prompt: Blocks) -> int:
        """Tokens the prompt's blocks name (its tail past them is unnamed, so unshared)."""
        return len(prompt.block_ids) * self.block_len
