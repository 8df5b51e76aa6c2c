"""`--discovery file`: the ranks listed in a JSON (or, with PyYAML, YAML) file, read again
whenever its mtime or size changes; a file that does not parse keeps the last good set."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvstrata.router.discovery_source import DiscoveredRank, Publish
from kvstrata.router.membership import WorkerRegistration
from kvstrata.router.workers import Role

logger = logging.getLogger("kvstrata.router")
# The file's items have the shape of a POST /workers body: url, role, optional rank.
RANK_LIST = TypeAdapter(list[WorkerRegistration])


class RankFileError(ValueError):
    """Why a rank file cannot be used (the message names no file: the caller does)."""


def read_rank_file(path: Path) -> frozenset[DiscoveredRank]:
    """The ranks a file lists. Raises RankFileError (unreadable, not JSON or YAML, not a
    list of {url, role[, rank]}, a URL listed twice)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RankFileError(f"cannot be read: {e}") from e
    items = _parse(text, yaml=path.suffix in (".yaml", ".yml"))
    try:
        bodies = RANK_LIST.validate_python(items)
    except ValidationError as e:
        problems = "; ".join(
            f"item {'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in e.errors()
        )
        raise RankFileError(f'not a list of {{"url", "role"[, "rank"]}}: {problems}') from e
    urls = [body.url for body in bodies]
    repeated = next((url for url in urls if urls.count(url) > 1), None)
    if repeated is not None:
        raise RankFileError(f"{repeated} is listed twice")
    return frozenset(DiscoveredRank(body.url, Role(body.role), body.rank) for body in bodies)


def _parse(text: str, yaml: bool) -> Any:
    if not yaml:
        try:
            return json.loads(text)
        except ValueError as e:
            raise RankFileError(f"not valid JSON: {e}") from e
    try:
        import yaml as pyyaml
    except ImportError as e:
        raise RankFileError("is YAML, but PyYAML is not installed (pip install pyyaml)") from e
    try:
        return pyyaml.safe_load(text)
    except pyyaml.YAMLError as e:
        raise RankFileError(f"not valid YAML: {e}") from e


class FileSource:
    """Checks the file's mtime and size every `interval_s` and publishes its ranks when
    they changed; a missing or malformed file is logged once per change."""

    name = "file"

    def __init__(self, path: str, interval_s: float) -> None:
        self.path = Path(path)
        self.interval_s = interval_s

    def _stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    async def run(self, publish: Publish) -> None:
        seen: tuple[int, int] | str | None = "never"
        num_good = 0
        while True:
            stamp = self._stamp()
            if stamp != seen:
                seen = stamp
                try:
                    ranks = read_rank_file(self.path)
                except RankFileError as e:
                    logger.error(
                        "--discovery-file %s %s; keeping the last good set (%d ranks)",
                        self.path,
                        e,
                        num_good,
                    )
                else:
                    num_good = len(ranks)
                    logger.info("--discovery-file %s lists %d ranks", self.path, num_good)
                    publish(ranks)
            await asyncio.sleep(self.interval_s)
