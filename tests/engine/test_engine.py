"""The engine end to end on real tiers: store/retrieve/lookup, masks, formats, faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tierkv
from tierkv import Engine, EngineBuilder


def config(tmp_path: Path, cpu: str = "256MiB", fmt: str = "vllm", chunk: int = 16, **extra: object) -> dict:
    return {"model": "test-model", "chunk_size": chunk, "kv_format": fmt, **extra,
            "tiers": [{"name": "host", "backend": "cpu", "capacity": cpu},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "1GiB"}]}


def kv_for(num_tokens: int, fmt: str = "vllm", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    shape = (3, 2, num_tokens, 2, 8) if fmt == "vllm" else (3, 2, 2, num_tokens, 8)
    return torch.randn(shape).to(dtype)


@pytest.fixture
def engine(tmp_path: Path):
    with Engine(config(tmp_path)) as eng:
        yield eng


def test_issue_example_verbatim(tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    cfg = tierkv.load_config({"model": "demo", "chunk_size": 256, "kv_format": "vllm",
                              "tiers": [{"name": "host", "backend": "cpu", "capacity": "1GiB"},
                                        {"name": "disk", "backend": "lmdb", "path": disk, "capacity": "4GiB"}]})
    eng = tierkv.Engine(cfg)
    torch.manual_seed(1234)
    tokens = torch.randint(0, 32000, (1000,))
    kv = torch.randn(4, 2, 1000, 8, 64, dtype=torch.bfloat16)
    eng.store(tokens, kv)
    assert eng.lookup(tokens) == 1000
    out, mask = eng.retrieve(tokens, return_tuple=False)
    assert mask.all() and torch.equal(out, kv)
    eng.close()
    # a new process with only the disk tier gets the same bytes back
    script = textwrap.dedent(f"""
        import torch, tierkv
        torch.manual_seed(1234)  # regenerate the same prompt and KV
        expected = {{"tokens": torch.randint(0, 32000, (1000,))}}
        expected["kv"] = torch.randn(4, 2, 1000, 8, 64, dtype=torch.bfloat16)
        cfg = tierkv.load_config({{"model": "demo", "chunk_size": 256, "kv_format": "vllm",
            "tiers": [{{"name": "disk", "backend": "lmdb", "path": {disk!r}, "capacity": "4GiB"}}]}})
        with tierkv.Engine(cfg) as eng:
            assert eng.lookup(expected["tokens"]) == 1000
            out, mask = eng.retrieve(expected["tokens"], return_tuple=False)
            assert mask.all() and torch.equal(out, expected["kv"])
        print("same bytes")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "same bytes" in result.stdout


@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_roundtrip_formats_blob_and_tuple(tmp_path: Path, fmt: str, as_tuple: bool) -> None:
    with Engine(config(tmp_path, fmt=fmt)) as eng:
        tokens = torch.randint(0, 1000, (50,))
        blob = kv_for(50, fmt)
        given = tuple((blob[i, 0], blob[i, 1]) for i in range(blob.shape[0])) if as_tuple else blob
        assert eng.store(tokens, given) == 4  # 3 full chunks of 16 and one of 2
        kv, mask = eng.retrieve(tokens)
        assert mask.all() and len(kv) == 3
        for layer, (k, v) in enumerate(kv):
            assert torch.equal(k, blob[layer, 0]) and torch.equal(v, blob[layer, 1])
        out, _ = eng.retrieve(tokens, return_tuple=False)
        assert torch.equal(out, blob)


def test_prefix_lookup_and_partial_retrieve(engine: Engine) -> None:
    tokens = torch.randint(0, 1000, (64,))
    blob = kv_for(64)
    engine.store(tokens, blob)
    longer = torch.cat([tokens, torch.randint(0, 1000, (40,))])
    assert engine.lookup(longer) == 64
    out, mask = engine.retrieve(longer, return_tuple=False)
    assert mask[:64].all() and not mask[64:].any()
    assert torch.equal(out, blob)
    diverged = tokens.clone()
    diverged[20] += 1  # second chunk differs: only the first chunk is a hit
    assert engine.lookup(diverged) == 16
    assert engine.lookup(torch.randint(2000, 3000, (30,))) == 0
    kv, mask = engine.retrieve(torch.randint(2000, 3000, (30,)))
    assert kv == () and not mask.any()


def test_suffix_masks(engine: Engine) -> None:
    tokens = torch.randint(0, 1000, (48,))
    blob = kv_for(48)
    mask = torch.ones(48, dtype=torch.bool)
    mask[:16] = False
    assert engine.store(tokens, blob[:, :, 16:], mask=mask) == 2
    assert engine.lookup(tokens) == 0, "the first chunk was never stored"
    engine.store(tokens[:16], blob[:, :, :16])
    assert engine.lookup(tokens) == 48
    rmask = torch.ones(48, dtype=torch.bool)
    rmask[:20] = False  # retrieve masks need not be chunk-aligned
    out, ret = engine.retrieve(tokens, mask=rmask, return_tuple=False)
    assert torch.equal(out, blob[:, :, 20:])
    assert torch.equal(ret, rmask)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e, t, kv: e.store(t, kv[:, :, :10]), "KV holds 10 tokens"),
        (lambda e, t, kv: e.store(t, kv[0]), "must be"),
        (lambda e, t, kv: e.store(t.view(4, 8), kv), "1-D"),
        (lambda e, t, kv: e.store(t.float(), kv), "integer dtype"),
        (lambda e, t, kv: e.store(t, kv, mask=torch.ones(31, dtype=torch.bool)), "31 entries"),
        (lambda e, t, kv: e.store(t, kv, mask=torch.tensor([True, False] * 16)), "suffix mask"),
        (lambda e, t, kv: e.store(t, kv[:, :, 5:], mask=torch.arange(32) >= 5), "aligned to chunks"),
        (lambda e, t, kv: e.store(t, ((kv[0, 0], kv[0, 1]), (kv[1, 0],))), r"\(K, V\) pair"),
        (lambda e, t, kv: e.retrieve(t, mask=torch.ones(32)), "torch.bool"),
    ],
)
def test_bad_input_is_a_clear_value_error_and_keeps_data(engine: Engine, call, message: str) -> None:
    tokens = torch.randint(0, 1000, (32,))
    blob = kv_for(32)
    engine.store(tokens, blob)
    with pytest.raises(ValueError, match=message):
        call(engine, tokens, blob)
    out, mask = engine.retrieve(tokens, return_tuple=False)
    assert mask.all() and torch.equal(out, blob), "nothing stored before is lost or altered"


def test_dtype_mismatch_with_config(tmp_path: Path) -> None:
    with Engine(config(tmp_path, dtype="float16")) as eng:
        with pytest.raises(ValueError, match="does not match the configured dtype"):
            eng.store(torch.arange(16), kv_for(16, dtype=torch.bfloat16))


def test_lower_tier_hit_is_promoted_and_survives_eviction(tmp_path: Path) -> None:
    # the cpu tier holds two chunks of 3*2*16*2*8*2 = 3 KiB; the working set is eight
    with Engine(config(tmp_path, cpu="7KiB")) as eng:
        prompts = [torch.randint(0, 1000, (16,)) + 1000 * i for i in range(8)]
        blobs = [kv_for(16) for _ in prompts]
        for tokens, blob in zip(prompts, blobs):
            eng.store(tokens, blob)
        stats = eng.stats()["tiers"]
        assert stats["host"]["evictions"] >= 6 and stats["host"]["used_bytes"] <= 7 * 1024
        out, mask = eng.retrieve(prompts[0], return_tuple=False)
        assert mask.all() and torch.equal(out, blobs[0])
        assert eng.stats()["tiers"]["host"]["promotions"] == 1
        assert eng.batched_contains(eng.keys_for(prompts[0])) == [True]
        assert asyncio_contains(eng, "host", prompts[0])


def asyncio_contains(eng: Engine, tier_name: str, tokens: torch.Tensor) -> bool:
    tier = next(t for t in eng.tiers if t.name == tier_name)
    return eng.run(tier.contains(eng.keys_for(tokens)[0]))


def test_corrupt_value_is_a_miss_deleted_and_counted(tmp_path: Path) -> None:
    import lmdb

    cfg = config(tmp_path)
    cfg["tiers"] = cfg["tiers"][1:]
    tokens = torch.randint(0, 1000, (32,))
    with Engine(cfg) as eng:
        eng.store(tokens, kv_for(32))
        second = eng.keys_for(tokens)[1].to_string().encode()
    env = lmdb.open(str(tmp_path / "db"), max_dbs=2)
    with env.begin(write=True) as txn:
        data = env.open_db(b"data", txn=txn)
        value = bytearray(txn.get(second, db=data))
        value[10] ^= 0xFF
        txn.put(second, bytes(value), db=data)
    env.close()
    with Engine(cfg) as eng:
        kv, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask[:16].all() and not mask[16:].any(), "the corrupt chunk is a miss, never a wrong tensor"
        assert eng.stats()["tiers"]["disk"]["corrupt_chunks"] == 1
        assert eng.lookup(tokens) == 16, "the corrupt chunk was deleted"


def test_skip_existing(engine: Engine) -> None:
    tokens = torch.randint(0, 1000, (48,))
    assert engine.store(tokens, kv_for(48)) == 3
    assert engine.store(tokens, kv_for(48)) == 0
    assert engine.store(tokens, kv_for(48), skip_existing=False) == 3


def test_closed_engine_raises(tmp_path: Path) -> None:
    eng = Engine(config(tmp_path))
    eng.close()
    eng.close()
    with pytest.raises(tierkv.BackendClosedError):
        eng.lookup(torch.arange(4))


def test_engine_builder(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    first = EngineBuilder.get_or_create("worker-0", cfg)
    try:
        assert EngineBuilder.get_or_create("worker-0", cfg) is first
        assert EngineBuilder.get("worker-0") is first
        with pytest.raises(ValueError, match="different configuration"):
            EngineBuilder.get_or_create("worker-0", config(tmp_path, chunk=32))
    finally:
        EngineBuilder.destroy("worker-0")
    assert EngineBuilder.get("worker-0") is None
    with pytest.raises(tierkv.BackendClosedError):
        first.lookup(torch.arange(4))


def test_concurrent_store_and_retrieve_from_many_threads(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with Engine(config(tmp_path, cpu="64KiB")) as eng:
        prompts = [torch.randint(0, 1000, (40,)) + 1000 * i for i in range(12)]
        blobs = [kv_for(40) for _ in prompts]

        def work(i: int) -> None:
            eng.store(prompts[i], blobs[i])
            out, mask = eng.retrieve(prompts[i], return_tuple=False)
            assert mask.all() and torch.equal(out, blobs[i])

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(work, range(12)))
        for tokens, blob in zip(prompts, blobs):
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, blob)
        assert eng.stats()["tiers"]["host"]["used_bytes"] <= 64 * 1024


def test_log_level_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from tierkv.errors import ConfigError

    loggers = [logging.getLogger("tierkv"), logging.getLogger("tierkv_backends")]
    before = [logger.level for logger in loggers]
    try:
        monkeypatch.setenv("TIERKV_LOG_LEVEL", "debug")
        with Engine(config(tmp_path)):
            assert [logger.level for logger in loggers] == [logging.DEBUG, logging.DEBUG]
        monkeypatch.setenv("TIERKV_LOG_LEVEL", "chatty")
        with pytest.raises(ConfigError, match="TIERKV_LOG_LEVEL: expected one of DEBUG.*'chatty'"):
            Engine(config(tmp_path))
    finally:
        for logger, level in zip(loggers, before):
            logger.setLevel(level)
