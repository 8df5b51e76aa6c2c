"""Prefill ranks reuse the KV the cluster holds: a decode rank writes its pages (prompt and
generated tokens) through to a shared L3 directory; a prefill rank with HiCache over the
same directory loads them after losing its own L1 and L2, computes only what no tier
holds, and a corrupt page is refused and computed instead (in process, real `ipc`)."""

from __future__ import annotations

from pathlib import Path

from kvstrata import LLM, SamplingParams
from kvstrata.core import RequestOutput
from kvstrata.engine.engine import Engine
from kvstrata.kvcache.hashing import page_hashes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 4


def cluster(model: Path, l3_dir: Path) -> tuple[Engine, Engine]:
    l3 = {
        "page_size": PAGE, "num_kv_pages": 256, "hicache_storage_backend": "file",
        "hicache_storage_dir": str(l3_dir), "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_prefetch_threshold": PAGE,
    }  # fmt: skip
    prefill = LLM(
        str(model), disaggregation_mode="prefill", enable_hierarchical_cache=True, **l3
    ).engine
    decode = LLM(
        str(model), disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
        disaggregation_decode_enable_hicache=True, disaggregation_decode_local_prefill="never",
        **l3,
    ).engine  # fmt: skip
    return prefill, decode


def serve(prefill: Engine, decode: Engine, prompt: list[int]) -> tuple[RequestOutput, int]:
    """One request through PD; its output and the prefill rank's L3 hit for it."""
    req = decode.add_request(prompt, GREEDY)
    final, prefill_l3_tokens = None, -1
    while final is None:
        final = next((o for o in decode.step() if o.rid == req.rid and o.finished), None)
        for task in decode.role.take_tasks():
            p_req = prefill.role.add_prefill_task(task)
            while prefill.has_unfinished:
                prefill.step()
            prefill_l3_tokens = p_req.num_cached_tokens_l3
            out = decode.role.complete_transfer(prefill.role.collect(p_req.rid))
            final = out if out.finished else final
    for engine in (prefill, decode):
        engine.tiers.wait_io()  # the L3 writes of both ranks have landed
        engine.tiers.poll()
    return final, prefill_l3_tokens


def unified(model: Path, prompt: list[int]) -> list[int]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True)
    return llm.generate(input_ids=[prompt], sampling_params=GREEDY)[0].output_ids


def test_prefill_loads_the_decode_ranks_pages_and_computes_only_new_tokens(
    tiny_llama: Path, tmp_path: Path
) -> None:
    prefill, decode = cluster(tiny_llama, tmp_path / "l3")
    turn1 = list(range(100, 140))  # 10 pages
    first, _ = serve(prefill, decode, turn1)
    # The decode rank held turn 1's 40 + 5 tokens with KV: 11 full pages, the 11th only it
    # computed (the prefill rank saw the prompt alone).
    assert prefill.flush_cache()  # the prefill rank loses its L1 and L2
    turn2 = turn1 + first.output_ids + list(range(7, 20))
    second, prefill_l3_tokens = serve(prefill, decode, turn2)
    assert prefill_l3_tokens == 44
    assert second.output_ids == unified(tiny_llama, turn2)


def test_a_corrupt_page_is_refused_and_computed(tiny_llama: Path, tmp_path: Path) -> None:
    prefill, decode = cluster(tiny_llama, tmp_path / "l3")
    turn1 = list(range(300, 340))
    first, _ = serve(prefill, decode, turn1)
    assert prefill.flush_cache()
    turn2 = turn1 + first.output_ids + list(range(30, 41))
    # Corrupt the decode-written 11th page in place (same size, header intact).
    hashes = page_hashes(turn2[:44], PAGE, decode.kv.namespace, None)
    path = decode.tiers.l3.backend.path_of(hashes[10])
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    path.write_bytes(bytes(data))
    second, prefill_l3_tokens = serve(prefill, decode, turn2)
    assert prefill_l3_tokens == 40  # the pages before the corrupt one
    assert second.output_ids == unified(tiny_llama, turn2)


def test_launch_gives_prefill_ranks_hicache_over_the_decode_ranks_l3(tiny_llama: Path) -> None:
    """The README's flag set for one cache across roles: prefill ranks get L2 and the
    shared L3, decode ranks their decode HiCache over the same directory."""
    from kvstrata.cluster.rank_flags import split_rank_flags

    flags = [
        "--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", "/tmp/kvstrata-l3",
    ]  # fmt: skip
    split = split_rank_flags(str(tiny_llama), flags, num_prefill=1, router_options={})
    prefill, decode = " ".join(split.prefill), " ".join(split.decode)
    assert "--enable-hierarchical-cache" in prefill and "--enable-hierarchical-cache" not in decode
    for role in (prefill, decode):
        assert "--hicache-storage-backend file --hicache-storage-dir /tmp/kvstrata-l3" in role
    assert "--disaggregation-decode-enable-hicache" in decode
    assert "--disaggregation-decode" not in prefill
