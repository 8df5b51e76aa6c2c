"""The launch proof: what a router started by `kvstrata launch` answers at
LAUNCH_PROOF_PATH to show it holds the launcher's key (an HMAC of the launcher's fresh
challenge; the key never travels). Shared by the router's endpoint and the launcher."""

from __future__ import annotations

import hashlib
import hmac

LAUNCH_PROOF_PATH = "/launch_proof"  # public on the router: its answer reveals no key
_PROOF_DOMAIN = b"kvstrata launch proof\0"  # this HMAC is for nothing else


def launch_proof(key: str, challenge: str) -> str:
    """What a router holding `key` answers to `challenge`."""
    return hmac.new(key.encode(), _PROOF_DOMAIN + challenge.encode(), hashlib.sha256).hexdigest()
