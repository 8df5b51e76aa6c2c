"""Who can read and write the `file` L3 store (issue 27.4): pages and the directory's key
are private (0600 in 0700), a directory another user owns or may write is refused at
start naming --hicache-storage-allow-shared-dir, another uid cannot read a page or the key,
and a page forged without the key (either format version, built from the documented
layout alone) is refused before a byte reaches L2, counted as a MAC refusal."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import storage_contract as contract
import torch
from l3_forgery import FORGED_VERSIONS, forged_page

from kvstrata.config import ConfigError, EngineConfig
from kvstrata.kvcache.storage.file import FileStorage
from kvstrata.kvcache.storage.trust import L3Trust, mac_key_from_secret

PAGE_BYTES = contract.PAGE_BYTES
NS = contract.NAMESPACE
NOBODY = 65534
SHARED_FLAG = "--hicache-storage-allow-shared-dir"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown and setuid need root")


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def write_pages(backend: FileStorage, num: int = 3, salt: int = 0) -> list[bytes]:
    page_keys = contract.keys(num, salt)
    assert backend.batch_set(page_keys, contract.random_pages(num, seed=salt)) == [True] * num
    return page_keys


@pytest.fixture
def public_parent() -> Iterator[Path]:
    """A 0755 directory outside pytest's private tmp tree: where a deployment's L3 lives
    (/var/cache/...), so only the L3 directory's own modes keep other users out."""
    parent = Path(tempfile.mkdtemp(prefix="kvstrata-l3-trust-"))
    os.chmod(parent, 0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# ---- modes ---------------------------------------------------------------------------------


def test_pages_and_key_are_private_by_default_and_group_readable_in_group_mode(
    public_parent: Path,
) -> None:
    private = FileStorage(public_parent / "private", PAGE_BYTES, NS)
    key = write_pages(private)[0]
    key_file = public_parent / "private" / "kvstrata-l3.key"
    assert mode_of(public_parent / "private") == 0o700
    assert mode_of(private.path_of(key).parent) == 0o700  # the fan-out subdirectory
    assert mode_of(private.path_of(key)) == 0o600 and mode_of(key_file) == 0o600

    old_umask = os.umask(0o077)  # the exact modes do not depend on the umask
    try:
        group = FileStorage(
            public_parent / "group", PAGE_BYTES, NS, trust=L3Trust(file_mode="group")
        )
        key = write_pages(group)[0]
    finally:
        os.umask(old_umask)
    assert mode_of(public_parent / "group") == 0o2770
    assert mode_of(group.path_of(key).parent) == 0o2770
    assert mode_of(group.path_of(key)) == 0o640
    assert mode_of(public_parent / "group" / "kvstrata-l3.key") == 0o640


def test_an_own_directory_with_loose_read_bits_is_tightened(public_parent: Path) -> None:
    directory = public_parent / "l3"
    (directory / "ab").mkdir(parents=True)
    os.chmod(directory, 0o755)  # what kvstrata made before, pages 0644 inside
    os.chmod(directory / "ab", 0o755)
    FileStorage(directory, PAGE_BYTES, NS)
    assert mode_of(directory) == 0o700 and mode_of(directory / "ab") == 0o700


# ---- shared directories are refused unless allowed ---------------------------------------


def refused(directory: Path, **trust: object) -> str:
    with pytest.raises(ConfigError, match=SHARED_FLAG) as raised:
        FileStorage(directory, PAGE_BYTES, NS, trust=L3Trust(**trust))  # type: ignore[arg-type]
    return str(raised.value)


def test_a_directory_others_may_write_is_refused_and_accepted_with_the_flag(
    tmp_path: Path,
) -> None:
    for mode in (0o777, 0o1777, 0o770):  # world-writable (sticky or not), group-writable
        directory = tmp_path / f"l3-{mode:o}"
        directory.mkdir()
        os.chmod(directory, mode)
        assert "writable by other users" in refused(directory)
        backend = FileStorage(directory, PAGE_BYTES, NS, trust=L3Trust(allow_shared_dir=True))
        write_pages(backend)
        assert mode_of(directory) == mode  # a shared directory is used, not changed
    group_dir = tmp_path / "l3-770"  # group-writable is what group mode is for
    FileStorage(group_dir, PAGE_BYTES, NS, trust=L3Trust(file_mode="group"))
    with pytest.raises(ConfigError, match=SHARED_FLAG):  # world-writable never is
        FileStorage(tmp_path / "l3-777", PAGE_BYTES, NS, trust=L3Trust(file_mode="group"))


@needs_root
def test_a_directory_or_subdirectory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    assert f"owned by uid {NOBODY}" in refused(theirs)
    FileStorage(theirs, PAGE_BYTES, NS, trust=L3Trust(allow_shared_dir=True))

    ours = tmp_path / "ours"
    FileStorage(ours, PAGE_BYTES, NS)
    (ours / "ab").mkdir(mode=0o700)  # a fan-out subdirectory planted by someone else
    os.chown(ours / "ab", NOBODY, NOBODY)
    assert "ab is owned by uid" in refused(ours)
    os.rmdir(ours / "ab")
    os.symlink(theirs, ours / "cd")  # a link could send our pages anywhere
    assert "not a directory" in refused(ours)


def test_the_engine_refuses_a_shared_directory_at_start(tiny_llama: Path, tmp_path: Path) -> None:
    from kvstrata import LLM

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    options = dict(
        page_size=4, num_kv_pages=64, enable_hierarchical_cache=True,
        hicache_storage_backend="file", hicache_storage_dir=str(shared),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=SHARED_FLAG):
        LLM(str(tiny_llama), **options)
    LLM(str(tiny_llama), hicache_storage_allow_shared_dir=True, **options).engine.close()


# ---- the directory's key -----------------------------------------------------------------


def test_the_key_file_is_made_once_and_shared_and_a_bad_one_refused(tmp_path: Path) -> None:
    first = FileStorage(tmp_path / "l3", PAGE_BYTES, NS)
    second = FileStorage(tmp_path / "l3", PAGE_BYTES, NS)  # another process of this user
    assert first.key_id == second.key_id
    page_keys = write_pages(first)
    assert second.batch_get(page_keys, contract.host_pool(3)) == [True] * 3
    # A given key overrides the directory's: it reads nothing the directory key signed.
    given = FileStorage(
        tmp_path / "l3", PAGE_BYTES, NS, trust=L3Trust(mac_key=mac_key_from_secret("s" * 40))
    )
    assert given.key_id != first.key_id
    assert given.batch_get(page_keys, contract.host_pool(3)) == [False] * 3
    assert given.stats().num_mac_refused == 3

    key_file = tmp_path / "l3" / "kvstrata-l3.key"
    os.chmod(key_file, 0o644)  # readable by others: everyone could sign pages
    with pytest.raises(ConfigError, match="--hicache-storage-key-file"):
        FileStorage(tmp_path / "l3", PAGE_BYTES, NS)
    key_file.unlink()
    os.symlink(tmp_path / "elsewhere", key_file)
    with pytest.raises(ConfigError, match=r"kvstrata-l3\.key"):
        FileStorage(tmp_path / "l3", PAGE_BYTES, NS)
    key_file.unlink()
    FileStorage(tmp_path / "l3", PAGE_BYTES, NS)  # a fresh key: old pages become misses
    assert mode_of(key_file) == 0o600


# Run as another user (a shell: the venv's python may sit where nobody may enter): tries
# to read each file and list each directory named.
PROBE = """for p; do
  if [ -d "$p" ]; then ls "$p" >/dev/null 2>&1; else head -c 1 "$p" >/dev/null 2>&1; fi \\
    && echo read || echo denied
done"""


@needs_root
def test_another_user_cannot_read_a_page_or_the_key(public_parent: Path) -> None:
    backend = FileStorage(public_parent / "l3", PAGE_BYTES, NS)
    page = backend.path_of(write_pages(backend)[0])
    key_file = public_parent / "l3" / "kvstrata-l3.key"
    assert key_file.exists()
    paths = [page, key_file, page.parent, public_parent / "l3", public_parent]
    done = subprocess.run(
        ["/bin/sh", "-c", PROBE, "probe", *map(str, paths)], cwd="/",
        preexec_fn=lambda: (os.setgid(NOBODY), os.setuid(NOBODY)),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    # The parent is a public directory (the control: the probe can read what it may).
    assert done.stdout.split() == ["denied"] * 4 + ["read"], done.stderr


# ---- forged pages: refused before a byte reaches L2 ----------------------------------------


def test_pages_forged_without_the_key_are_refused_before_reaching_l2(tmp_path: Path) -> None:
    backend = FileStorage(tmp_path / "l3", PAGE_BYTES, NS)
    page_keys = write_pages(backend, num=4)
    other_kv = [p.numpy().tobytes() for p in contract.random_pages(4, seed=99)]
    for version in FORGED_VERSIONS:
        for key, payload in zip(page_keys, other_kv):
            backend.path_of(key).write_bytes(forged_page(version, NS, key, payload))
        out = contract.host_pool(4)
        for page in out:
            page.fill_(0xA5)
        assert backend.batch_get(page_keys, out) == [False] * 4
        assert all(torch.all(page == 0xA5) for page in out)  # not one forged byte landed
        assert not any(backend.path_of(k).exists() for k in page_keys)  # dropped: rewritten
        write_pages(backend, num=4)  # the rank recomputes and stores them again
    stats = backend.stats()
    assert (stats.num_corrupt_pages, stats.num_mac_refused) == (8, 4)  # v1: bad_magic
    out = contract.host_pool(4)
    assert backend.batch_get(page_keys, out) == [True] * 4
    assert all(torch.equal(o, p) for o, p in zip(out, contract.random_pages(4)))


# ---- the engine options ------------------------------------------------------------------


def test_engine_options_hold_the_key_hidden_and_refuse_combinations(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = str(tiny_llama)
    l3 = dict(enable_hierarchical_cache=True, hicache_storage_backend="file",
              hicache_storage_dir=str(tmp_path))  # fmt: skip
    key_file = tmp_path / "l3.key"
    key_file.write_text("a-secret-of-forty-characters-0123456789\n")
    config = EngineConfig.from_flags(model=model, hicache_storage_key_file=str(key_file), **l3)
    assert config.l3_key_secret == "a-secret-of-forty-characters-0123456789"
    shown = repr(config) + str(dataclasses.asdict(config))
    assert "forty" not in shown and "'key': {'is_set': True}" in shown
    # A served rank's cluster key keys L3 unless a key was given; no L3, no key.
    assert config.with_l3_key("cluster") is config
    assert (
        EngineConfig.from_flags(model=model, **l3).with_l3_key("cluster").l3_key_secret == "cluster"
    )
    assert EngineConfig.from_flags(model=model).with_l3_key("cluster").l3_key_secret is None
    with pytest.raises(ConfigError, match=r"--hicache-storage-key-file.*needs"):
        EngineConfig.from_flags(model=model, hicache_storage_key_file=str(key_file))
    for name, value in (("hicache_storage_file_mode", "group"),
                        ("hicache_storage_allow_shared_dir", True)):  # fmt: skip
        flag = "--" + name.replace("_", "-")
        with pytest.raises(ConfigError, match=f"{flag} needs --hicache-storage-backend file"):
            EngineConfig.from_flags(model=model, enable_hierarchical_cache=True,
                         hicache_storage_backend="mooncake", **{name: value})  # fmt: skip
