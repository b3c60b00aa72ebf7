"""GPU connectors through a real engine (cpu + LMDB tiers): a paged cache stored and retrieved
into another paged cache with a different slot mapping, bit-exact, with and without the extension."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from paged_caches import build_extension_for_tests, make_cache, same_bytes

from tierkv import AsyncEngine, Engine, ops
from tierkv.connectors import (
    NestedTupleConnector,
    PagedConnector,
    PagedConnectorV2,
    retrieve_paged,
    retrieve_with_connector,
    store_paged,
    store_with_connector,
)

LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, BLOCKS, CHUNK = 3, 2, 8, 4, 32, 16


def config(tmp_path: Path, fmt: str = "vllm") -> dict:
    return {"model": "connector-test", "chunk_size": CHUNK, "kv_format": fmt,
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "64MiB"},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "1GiB"}]}


@pytest.fixture(params=["extension", "reference"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test once through the extension's kernels and once with TIERKV_NO_EXT=1."""
    if request.param == "extension":
        build_extension_for_tests(request.config)
        monkeypatch.delenv("TIERKV_NO_EXT", raising=False)
        assert ops.extension_status()["in_use"]
    else:
        monkeypatch.setenv("TIERKV_NO_EXT", "1")
        assert not ops.extension_status()["in_use"]
    return request.param


def shuffled_slots(num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(BLOCKS * BLOCK_SIZE, generator=generator)[:num_tokens]


@pytest.mark.parametrize("layout", ["pairs", "fused"])
@pytest.mark.parametrize("connector_class", [PagedConnector, PagedConnectorV2])
def test_paged_round_trip_into_a_different_slot_mapping(
    tmp_path: Path, kernels: str, layout: str, connector_class: type
) -> None:
    num_tokens = 45  # two full chunks and a partial one
    tokens = torch.randint(0, 50_000, (num_tokens,))
    source = make_cache(layout, LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.bfloat16)
    source_slots = shuffled_slots(num_tokens, 1)
    target = [torch.zeros_like(layer) if layout == "fused" else tuple(torch.zeros_like(t) for t in layer)
              for layer in source]
    target_slots = shuffled_slots(num_tokens, 2).int()
    connector = connector_class(LAYERS, HEADS, HEAD_SIZE)
    with Engine(config(tmp_path)) as engine:
        assert store_paged(engine, connector, tokens, kvcaches=source, slot_mapping=source_slots) == 3
        assert store_paged(engine, connector, tokens, kvcaches=source, slot_mapping=source_slots) == 0
        ret_mask = retrieve_paged(engine, connector, tokens, kvcaches=target, slot_mapping=target_slots)
    assert bool(ret_mask.all())
    assert same_bytes(ops.paged_gather_reference(target, target_slots), ops.paged_gather_reference(source, source_slots))
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[target_slots.long()] = False
    keys, values = ops.split_paged_cache(target)
    for tensor in keys + values:
        assert torch.count_nonzero(tensor.reshape(-1, HEADS, HEAD_SIZE)[untouched]) == 0


def test_async_store_and_retrieve_with_prefix_mask(tmp_path: Path, kernels: str) -> None:
    """A prompt whose first chunk is already cached: slot_mapping starts with -1 there (prefix
    caching), the store mask skips it, and retrieval fills only what the mask asks for."""
    num_tokens = 40
    tokens = torch.randint(0, 50_000, (num_tokens,))
    source = make_cache("pairs", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float16)
    slots = shuffled_slots(num_tokens, 3)
    slots[:CHUNK] = -1
    store_mask = torch.ones(num_tokens, dtype=torch.bool)
    store_mask[:CHUNK] = False
    connector = PagedConnector(LAYERS, HEADS, HEAD_SIZE)

    async def scenario() -> tuple[int, torch.Tensor, list]:
        engine = AsyncEngine(config(tmp_path))
        try:
            written = await store_with_connector(engine, connector, tokens, store_mask, kvcaches=source,
                                                 slot_mapping=slots)
            target = make_cache("pairs", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float16)
            target_slots = shuffled_slots(num_tokens, 4)
            ret_mask = await retrieve_with_connector(engine, connector, tokens, store_mask, kvcaches=target,
                                                     slot_mapping=target_slots)
            return written, ret_mask, [target, target_slots]
        finally:
            await engine.close()

    written, ret_mask, (target, target_slots) = asyncio.run(scenario())
    assert written == 2
    assert torch.equal(ret_mask, store_mask)
    assert same_bytes(ops.paged_gather_reference(target, target_slots[CHUNK:]),
                      ops.paged_gather_reference(source, slots[CHUNK:]))


@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
def test_nested_tuple_round_trip(tmp_path: Path, fmt: str) -> None:
    num_tokens = 37
    tokens = torch.randint(0, 50_000, (num_tokens,))
    shape = (num_tokens, HEADS, HEAD_SIZE) if fmt == "vllm" else (HEADS, num_tokens, HEAD_SIZE)
    source = tuple((torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS))
    target = tuple((torch.zeros(shape).bfloat16(), torch.zeros(shape).bfloat16()) for _ in range(LAYERS))
    connector = NestedTupleConnector(LAYERS, HEADS, HEAD_SIZE, fmt=fmt)
    assert connector.get_shape(5) == ((LAYERS, 2, 5, HEADS, HEAD_SIZE) if fmt == "vllm"
                                      else (LAYERS, 2, HEADS, 5, HEAD_SIZE))
    with Engine(config(tmp_path, fmt)) as engine:
        assert store_paged(engine, connector, tokens, kvcaches=source) == 3
        ret_mask = retrieve_paged(engine, connector, tokens, kvcaches=target)
    assert bool(ret_mask.all())
    for (k1, v1), (k2, v2) in zip(source, target):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_connector_from_gpu_to_gpu_on_a_tensor_range() -> None:
    source = make_cache("fused", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float32)
    slots = shuffled_slots(20, 5)
    connector = PagedConnectorV2(LAYERS, HEADS, HEAD_SIZE, fmt="huggingface")
    blob = torch.empty(connector.get_shape(8))
    connector.from_gpu(blob, 4, 12, kvcaches=source, slot_mapping=slots)
    assert torch.equal(blob, ops.paged_gather_reference(source, slots[4:12], order="huggingface"))


def test_missing_kwargs_and_mismatches_are_value_errors(tmp_path: Path) -> None:
    cache = make_cache("pairs", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float32)
    connector = PagedConnector(LAYERS, HEADS, HEAD_SIZE)
    blob = torch.zeros(connector.get_shape(4))
    with pytest.raises(ValueError, match="'kvcaches' must be provided"):
        connector.from_gpu(blob, 0, 4, slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="'slot_mapping' must be provided"):
        connector.to_gpu(blob, 0, 4, kvcaches=cache)
    with pytest.raises(ValueError, match="'kvcaches' must be provided"):
        NestedTupleConnector(LAYERS, HEADS, HEAD_SIZE).from_gpu(blob, 0, 4)
    with pytest.raises(ValueError, match="slot_mapping has 3 entries but tokens up to 4"):
        connector.from_gpu(blob, 0, 4, kvcaches=cache, slot_mapping=torch.arange(3))
    with pytest.raises(ValueError, match=r"memory_obj tensor must be vllm \(3, 2, 5, 2, 8\)"):
        connector.from_gpu(blob, 0, 5, kvcaches=cache, slot_mapping=torch.arange(5))
    with pytest.raises(ValueError, match="fmt must be one of"):
        PagedConnector(LAYERS, HEADS, HEAD_SIZE, fmt="sglang")
    with Engine(config(tmp_path, "huggingface")) as engine:
        with pytest.raises(ValueError, match="connector produces 'vllm' blobs but the engine stores 'huggingface'"):
            store_paged(engine, connector, torch.arange(4), kvcaches=cache, slot_mapping=torch.arange(4))
        assert engine.lookup(torch.arange(4)) == 0


def test_retrieve_miss_leaves_the_cache_alone(tmp_path: Path) -> None:
    target = make_cache("pairs", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float32)
    before = [tuple(t.clone() for t in layer) for layer in target]
    with Engine(config(tmp_path)) as engine:
        ret_mask = retrieve_paged(engine, PagedConnector(LAYERS, HEADS, HEAD_SIZE), torch.arange(20),
                                  kvcaches=target, slot_mapping=torch.arange(20))
    assert not bool(ret_mask.any())
    assert all(torch.equal(a, b) for pa, pb in zip(target, before) for a, b in zip(pa, pb))


def test_cuda_paged_round_trip(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the device-side connector path needs a GPU")
    num_tokens = 45
    tokens = torch.randint(0, 50_000, (num_tokens,))
    source = make_cache("fused", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.bfloat16, "cuda")
    target = [torch.zeros_like(layer) for layer in source]
    source_slots, target_slots = shuffled_slots(num_tokens, 1).cuda(), shuffled_slots(num_tokens, 2).cuda()
    connector = PagedConnectorV2(LAYERS, HEADS, HEAD_SIZE)
    with Engine(config(tmp_path)) as engine:
        store_paged(engine, connector, tokens, kvcaches=source, slot_mapping=source_slots)
        assert bool(retrieve_paged(engine, connector, tokens, kvcaches=target, slot_mapping=target_slots).all())
    assert same_bytes(ops.paged_gather_reference(target, target_slots), ops.paged_gather_reference(source, source_slots))


@pytest.mark.parametrize("lower", [False, True], ids=["cpu-tier", "via-lmdb"])
def test_connector_round_trip_copies_each_byte_once(tmp_path: Path, lower: bool) -> None:
    """Gathered straight into the host tier's slabs, scattered straight out of them: one copy
    each way, counted; a chunk that comes from lmdb costs one read (+ its promotion) more."""
    num_tokens = 2 * CHUNK
    tokens = torch.randint(0, 50_000, (num_tokens,))
    source = make_cache("pairs", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.bfloat16)
    source_slots = shuffled_slots(num_tokens, 3)
    target = [tuple(torch.zeros_like(t) for t in layer) for layer in source]
    target_slots = shuffled_slots(num_tokens, 4)
    connector = PagedConnector(LAYERS, HEADS, HEAD_SIZE)
    nbytes = LAYERS * 2 * num_tokens * HEADS * HEAD_SIZE * 2
    with Engine(config(tmp_path)) as engine:
        store_paged(engine, connector, tokens, kvcaches=source, slot_mapping=source_slots)
        engine.flush()
        if lower:
            for key in engine.keys_for(tokens):
                engine.run(engine.tiers[0].delete(key))
        assert bool(retrieve_paged(engine, connector, tokens, kvcaches=target, slot_mapping=target_slots).all())
        copies = engine.stats()["copies"]
    assert same_bytes(ops.paged_gather_reference(target, target_slots), ops.paged_gather_reference(source, source_slots))
    assert copies["store"]["copied_bytes"] == nbytes and copies["store"]["copies_per_byte"] == 1.0
    assert copies["retrieve"]["delivered_bytes"] == nbytes
    assert copies["retrieve"]["copied_bytes"] == (2 if lower else 1) * nbytes
