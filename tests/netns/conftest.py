"""The across-hosts tests reuse the fault tests' load and judge (tests/faults/fault_load.py:
conversations, the OpenAI-style error check, the unified reference)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
