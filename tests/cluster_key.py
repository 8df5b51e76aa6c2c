"""The cluster key of the processes tests start: every child inherits it through the
environment (hand-started PD ranks and routers need one), and a test that stands in for
the router sends ROUTER_KEY beside X-Kvstrata-Prefill-Url. Imported by tests/conftest.py."""

from __future__ import annotations

import os

from kvstrata.config.server import CLUSTER_KEY_ENV
from kvstrata.http.middleware import CLUSTER_KEY_HEADER

os.environ.setdefault(CLUSTER_KEY_ENV, "test-cluster-key-5c1d")
TEST_CLUSTER_KEY = os.environ[CLUSTER_KEY_ENV]
ROUTER_KEY = {CLUSTER_KEY_HEADER: TEST_CLUSTER_KEY}
