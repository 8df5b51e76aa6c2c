"""`TpotBudget`: the share of the running decodes' step time that a decode rank's own
prompt tokens (local prefill) took lately, against the budget `auto` local prefill may
spend of it (`--disaggregation-decode-local-prefill-tpot-budget`): past it, prompts go to
the prefill rank until the share falls back."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# The share follows the run's average over the last minute or so: a step 20 s old weighs
# half a new one (a burst of local prefills must not flip the next few requests remote).
_HALF_LIFE_S = 20.0


class TpotBudget:
    def __init__(
        self,
        budget: float,
        clock: Callable[[], float] = time.monotonic,
        half_life_s: float = _HALF_LIFE_S,
    ) -> None:
        self.budget = budget
        self.clock = clock
        self.half_life_s = half_life_s
        self._prefill_s = 0.0  # decayed seconds of prompt tokens in steps that decoded
        self._step_s = 0.0  # decayed seconds of steps that decoded
        self._at_s = clock()
        self.num_refused = 0  # local prefills the budget sent to the prefill rank

    def observe(self, prefill_s: float, step_s: float, num_decodes: int) -> None:
        """A step of `step_s`, of which about `prefill_s` computed prompt tokens; only
        steps with running decodes count (a step of prompts alone slows no decode)."""
        if num_decodes == 0 or step_s <= 0:
            return
        self._decay()
        self._prefill_s += min(max(prefill_s, 0.0), step_s)
        self._step_s += step_s

    @property
    def share(self) -> float:
        """Of the running decodes' recent step time, the fraction prompt tokens took."""
        self._decay()
        return self._prefill_s / self._step_s if self._step_s > 0 else 0.0

    def allows(self, num_running_reqs: int) -> bool:
        """Whether a local prefill may start now: nothing decodes, or the share is
        within the budget (a budget >= 1 never refuses)."""
        if num_running_reqs == 0 or self.budget >= 1.0 or self.share <= self.budget:
            return True
        self.num_refused += 1
        return False

    def _decay(self) -> None:
        now_s = self.clock()
        factor = math.exp2(-(now_s - self._at_s) / self.half_life_s)
        self._prefill_s *= factor
        self._step_s *= factor
        self._at_s = now_s
