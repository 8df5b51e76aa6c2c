"""The token ids the simulator gives an agentic workload, and each session's context as
token ids plus its chained page hashes (grown in place as turns append). Fresh tokens are
never shared; a trace block's tokens are a function of its id alone, so the radix tree
shares exactly what the workload shares."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.kvcache.hashing import page_hashes
from kvstrata.sim.agent_sessions import AgentWorkload, Appended, Blocks
from kvstrata.sim.trace import SIM_NAMESPACE

# Page hashes pack token ids as 4-byte unsigned ints: blocks use ids below FRESH_BASE,
# fresh tokens the ids above it.
FRESH_BASE = 1 << 31
MAX_TOKEN_ID = (1 << 32) - 1


class Context:
    """One session's context: its token ids and the chained hash of every full page.
    Append-only, so a hash list handed out stays a valid prefix."""

    def __init__(self, page_size: int, token_ids: Sequence[int] = ()) -> None:
        self.page_size = page_size
        self.token_ids: list[int] = []
        self.page_hashes: list[bytes] = []
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens; pages they complete get their chained hash."""
        self.token_ids.extend(token_ids)
        start = len(self.page_hashes) * self.page_size
        prev = self.page_hashes[-1] if self.page_hashes else None
        self.page_hashes += page_hashes(self.token_ids[start:], self.page_size, SIM_NAMESPACE, prev)

    def copy(self) -> Context:
        """A sub-agent's context: the parent's so far (hashes shared, not recomputed)."""
        other = Context(self.page_size)
        other.token_ids = list(self.token_ids)
        other.page_hashes = list(self.page_hashes)
        return other

    def hashes(self, num_pages: int) -> list[bytes]:
        """A `HashSource` over this context's full pages."""
        return self.page_hashes[:num_pages]


class SimTokens:
    """Hands out the workload's tokens: each kind's prefix (drawn once), fresh tokens
    for appended prompts, answers and trace tails, and trace blocks."""

    def __init__(self, workload: AgentWorkload, page_size: int) -> None:
        self.workload = workload
        self.page_size = page_size
        self._next_fresh = FRESH_BASE
        self._prefixes = [self.fresh(n) for n in workload.prefix_lens]
        num_blocks = 1 + max(
            (
                max(t.prompt.block_ids, default=-1)
                for s in workload.sessions
                for t in s.turns
                if isinstance(t.prompt, Blocks)
            ),
            default=-1,
        )
        if num_blocks * workload.block_len > FRESH_BASE:
            raise ValueError("too many trace blocks for 32-bit token ids: shrink the trace")

    def fresh(self, num_tokens: int) -> list[int]:
        """`num_tokens` token ids never handed out before."""
        start = self._next_fresh
        self._next_fresh += num_tokens
        if self._next_fresh > MAX_TOKEN_ID:
            raise ValueError("the simulation ran out of 32-bit token ids")
        return list(range(start, start + num_tokens))

    def root_context(self, kind: int) -> Context:
        """A root session's context before its first turn: its kind's prefix (if any)."""
        prefix = self._prefixes[kind] if kind < len(self._prefixes) else []
        return Context(self.page_size, prefix)

    def prompt(self, context: Context, turn_prompt: Appended | Blocks) -> Context:
        """The context a turn sends: `context` grown by the appended tokens, or, for a
        trace turn, a new context holding the trace's whole prompt."""
        if isinstance(turn_prompt, Appended):
            context.extend(self.fresh(turn_prompt.num_tokens))
            return context
        block_len = self.workload.block_len
        token_ids: list[int] = []
        for block_id in turn_prompt.block_ids:
            token_ids.extend(range(block_id * block_len, (block_id + 1) * block_len))
        del token_ids[turn_prompt.input_len :]
        token_ids += self.fresh(turn_prompt.input_len - len(token_ids))
        return Context(self.page_size, token_ids)
