"""A chunk's key binds everything its KV depends on: adapter, tenant salt, media, model
revision and KV dtype (real engines over real cpu, lmdb and fs tiers)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from tierkv import Engine, EngineMetadata, MediaSpan, RequestIdentity
from tierkv.chunks.identity import KEY_FORMAT
from tierkv.chunks.keys import CacheKey, ChunkHasher, scope_of
from tierkv.chunks.revisions import adapter_identity, directory_revision

CHUNK, LAYERS, HEADS, HEAD = 16, 2, 2, 4


def kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, num_tokens, HEADS, HEAD, generator=torch.Generator().manual_seed(seed))


def config(tmp_path: Path, tier: str = "cpu") -> dict[str, object]:
    tiers = {"cpu": {"name": "host", "backend": "cpu", "capacity": "16MiB"},
             "lmdb": {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
             "fs": {"name": "files", "backend": "fs", "path": str(tmp_path / "fs")}}
    return {"model": "m", "chunk_size": CHUNK, "cost_aware": False, "tiers": [tiers[tier]]}


TOKENS = torch.arange(5 * CHUNK) % 97


def test_salts_and_adapters_never_share_a_chunk(tmp_path: Path) -> None:
    identities = [RequestIdentity(), RequestIdentity(salt="tenant-a"), RequestIdentity(salt="tenant-b"),
                  RequestIdentity(adapter="adapter:1"), RequestIdentity(adapter="adapter:1", salt="tenant-a"),
                  RequestIdentity(adapter="adapter:2")]
    with Engine(config(tmp_path)) as engine:
        for index, identity in enumerate(identities):
            assert engine.lookup(TOKENS, identity=identity) == 0, f"{identity.describe()}: nothing of the others"
            assert engine.store(TOKENS, kv(len(TOKENS), index), identity=identity) == 5
        for index, identity in enumerate(identities):
            assert engine.lookup(TOKENS, identity=identity) == len(TOKENS)
            got, mask = engine.retrieve(TOKENS, return_tuple=False, identity=identity)
            assert bool(mask.all()) and torch.equal(got, kv(len(TOKENS), index)), "each identity's own KV"
        keys = [engine.keys_for(TOKENS, identity) for identity in identities]
        assert len({key for chain in keys for key in chain}) == 5 * len(identities), "no key is shared"
        assert len({chain[0].scope for chain in keys}) == len(identities), "each identity has its own scope"
        stats = engine.stats()
        occupancy = engine.occupancy()
    text = json.dumps(stats, default=str) + json.dumps(occupancy, default=str)
    assert "tenant-a" not in text and "tenant-b" not in text, "a salt is never shown"
    scopes = stats["identity"]["scopes"]
    assert sorted(map(str, scopes.values())).count("{'salted': True}") == 2
    usage = occupancy["tiers"]["host"]
    assert sorted(entry["chunks"] for entry in usage.values()) == [5] * len(identities)
    assert all(occupancy["scopes"][scope] == scopes[scope] for scope in usage)


def test_media_change_the_chunks_from_the_first_they_overlap(tmp_path: Path) -> None:
    """Same placeholder tokens, another image: the chunks before the image's first chunk are
    shared with a text-only request; from it on, each image has its own."""
    image_a = RequestIdentity(media=(MediaSpan("image-a", 40, 30),))  # tokens 40..69: chunks 2, 3, 4
    image_b = RequestIdentity(media=(MediaSpan("image-b", 40, 30),))
    moved = RequestIdentity(media=(MediaSpan("image-a", 56, 30),))  # the same image two chunks on
    with Engine(config(tmp_path)) as engine:
        assert engine.store(TOKENS, kv(len(TOKENS)), identity=image_a) == 5
        assert engine.lookup(TOKENS, identity=image_a) == len(TOKENS)
        assert engine.lookup(TOKENS, identity=image_b) == 2 * CHUNK, "a new image: only the text before it"
        assert engine.lookup(TOKENS) == 2 * CHUNK, "text-only shares the prefix before the image"
        assert engine.lookup(TOKENS, identity=moved) == 2 * CHUNK, "elsewhere in the prompt: its own chunks"
        assert engine.store(TOKENS, kv(len(TOKENS), 1)) == 3, "text-only stores the 3 chunks after the prefix"
        assert engine.lookup(TOKENS, identity=moved) == 3 * CHUNK, "before the moved image: the text's chunks"
        got, mask = engine.retrieve(TOKENS, return_tuple=False, identity=image_b)
        assert int(mask.sum()) == 2 * CHUNK and torch.equal(got, kv(len(TOKENS))[:, :, : 2 * CHUNK])
    plain = engine.keys_for(TOKENS)
    assert engine.keys_for(TOKENS, image_a)[:2] == plain[:2] and engine.keys_for(TOKENS, image_a)[2] != plain[2]


def test_revision_and_kv_dtype_are_in_every_key(tmp_path: Path) -> None:
    """Engines over one lmdb directory, one after the other: another model revision or KV cache
    dtype under the same model name is a miss; the same one is a hit."""
    cfg = config(tmp_path, "lmdb")
    with Engine(cfg, EngineMetadata("m", model_revision="r1")) as engine:
        engine.store(TOKENS, kv(len(TOKENS)))
    for metadata, found in ((EngineMetadata("m", model_revision="r2"), 0),
                            (EngineMetadata("m", model_revision="r1", kv_cache_dtype="fp8_e4m3"), 0),
                            (EngineMetadata("m"), 0),
                            (EngineMetadata("m", model_revision="r1", identity=(("quantization", "awq"),)), 0),
                            (EngineMetadata("m", model_revision="r1"), len(TOKENS))):
        with Engine(cfg, metadata) as engine:
            assert engine.lookup(TOKENS) == found, metadata
    with Engine({**cfg, "model_revision": "r1"}) as engine:
        assert engine.lookup(TOKENS) == len(TOKENS), "model_revision in the config binds the same revision"


def test_a_cache_of_an_older_tierkv_is_a_miss(tmp_path: Path) -> None:
    """Keys before scopes: ``fmt@model@world@worker@hash``, the chain unseeded. Such a chunk,
    the same tokens and model, is never read by a current engine (and shows as scope '')."""
    old_hashes = ChunkHasher(CHUNK).prefix_hashes(TOKENS)  # what the older tierkv hashed
    old_keys = [CacheKey("vllm", "m", 1, 0, chunk_hash) for chunk_hash in old_hashes]
    with Engine(config(tmp_path, "fs")) as engine:
        chunks = [kv(len(TOKENS))[:, :, i * CHUNK:(i + 1) * CHUNK] for i in range(5)]
        assert engine.batched_put(old_keys, chunks) == 5
        assert engine.lookup(TOKENS) == 0, "an old key is never a current key"
        assert all(key.chunk_hash not in old_hashes for key in engine.keys_for(TOKENS))
    assert old_keys[0].to_string().count("@") == 4 and scope_of(old_keys[0].to_string()) == ""
    assert KEY_FORMAT in (b"tierkv-key-v2",)


def test_unidentified_requests_are_counted(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        engine.note_unidentified()
        assert engine.stats()["identity"]["unidentified_requests"] == 1


def test_bad_identities_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="MediaSpan.length"):
        MediaSpan("h", 3, 0)
    with pytest.raises(ValueError, match="MediaSpan.offset"):
        MediaSpan("h", -1, 2)
    with pytest.raises(ValueError, match="RequestIdentity.salt"):
        RequestIdentity(salt=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="media must be"):
        RequestIdentity.from_wire({"media": [["h", "x", 1]]})
    with pytest.raises(ValueError, match="model_revision"):
        EngineMetadata("m", model_revision=5)  # type: ignore[arg-type]
    assert RequestIdentity.from_wire(RequestIdentity("a", "s", (MediaSpan("h", 1, 2),), ("x",)).to_wire()) == \
        RequestIdentity("a", "s", (MediaSpan("h", 1, 2),), ("x",))


def write_model(path: Path, weights: bytes, config_text: str = '{"hidden_size": 8}') -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config_text)
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_directory_revision_follows_the_weights_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_REVISION_CACHE", str(tmp_path / "cache.json"))
    model = write_model(tmp_path / "model", os.urandom(1 << 20))
    first = directory_revision(model)
    assert directory_revision(model) == first, "stable"
    cached = json.loads((tmp_path / "cache.json").read_text())
    assert len(cached) == 1, "the weight file's digest is remembered by path, size, inode and times"
    write_model(model, os.urandom(1 << 20))  # re-trained: same name, same size, new bytes
    assert directory_revision(model) != first
    other = write_model(tmp_path / "other", (model / "model.safetensors").read_bytes())
    assert directory_revision(other) == directory_revision(model), "the same files elsewhere: the same revision"
    (other / "config.json").write_text('{"hidden_size": 16}')
    assert directory_revision(other) != directory_revision(model), "the config is part of it"
    with pytest.raises(ValueError, match="expected a model or adapter directory"):
        directory_revision(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no weight files"):
        directory_revision(tmp_path / "empty")
    assert adapter_identity(other).startswith("adapter:")


def test_a_hub_cache_link_is_named_by_its_blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight file linked into the hub cache's blobs/<sha256> is never read."""
    monkeypatch.setenv("TIERKV_REVISION_CACHE", str(tmp_path / "cache.json"))
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    data = os.urandom(4096)
    blob = blobs / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    snapshot = write_model(tmp_path / "snapshot", b"")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(blob)
    directory_revision(snapshot)
    assert not (tmp_path / "cache.json").exists(), "nothing was hashed"


def test_inspect_shows_occupancy_per_scope_without_keys_or_salts(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Two tenants' chunks in an lmdb tier, written by one process; ``tierkv inspect`` in
    another look counts them per scope and names neither a key nor a salt."""
    import yaml

    from tierkv.cli import main

    cfg = config(tmp_path, "lmdb")
    with Engine(cfg) as engine:
        for index, salt in enumerate(("tenant-secret-a", "tenant-secret-b")):
            engine.store(TOKENS, kv(len(TOKENS), index), identity=RequestIdentity(salt=salt))
        keys = [key.to_string() for key in engine.keys_for(TOKENS, RequestIdentity(salt="tenant-secret-a"))]
    path = tmp_path / "tierkv.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["inspect", str(path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed)
    usage = report["occupancy"]["tiers"]["disk"]
    assert sorted(entry["chunks"] for entry in usage.values()) == [5, 5], usage
    assert "tenant-secret" not in printed and not any(key in printed for key in keys)
