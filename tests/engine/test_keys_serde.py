"""Chunk keys (determinism, escaping) and the chunk byte format (round trip, corruption)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tierkv import CacheKey, ChunkFormatError, ChunkHasher
from tierkv.chunks import serde
from tierkv.chunks.keys import KeyMaker, as_token_array


def test_hashes_are_identical_across_processes_and_hash_seeds() -> None:
    script = "import torch; from tierkv import ChunkHasher; print(ChunkHasher(4).prefix_hashes(torch.arange(10)))"
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.add(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                   check=True).stdout)
    assert len(outputs) == 1
    assert eval(outputs.pop()) == ChunkHasher(4).prefix_hashes(torch.arange(10))


def test_prefix_chaining_and_partial_last_chunk() -> None:
    hasher = ChunkHasher(4)
    a = hasher.prefix_hashes(torch.arange(10))
    b = hasher.prefix_hashes(torch.arange(12))
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2], "shared full chunks share hashes"
    assert a[2] != b[2], "a partial chunk differs from the full one that extends it"
    changed = torch.arange(10)
    changed[0] = 99
    assert all(x != y for x, y in zip(hasher.prefix_hashes(changed), a)), "every later chunk depends on the prefix"


def test_hash_does_not_depend_on_integer_dtype() -> None:
    hasher = ChunkHasher(8)
    tokens = torch.randint(0, 32000, (50,))
    assert hasher.prefix_hashes(tokens) == hasher.prefix_hashes(tokens.to(torch.int32))
    assert hasher.prefix_hashes(tokens) == hasher.prefix_hashes(tokens.tolist())


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, dtype=torch.long), torch.rand(5), torch.tensor([-1, 2])])
def test_bad_tokens_are_value_errors(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="token"):
        ChunkHasher(4).prefix_hashes(bad)


def test_key_string_form_is_escaped_and_reversible() -> None:
    key = CacheKey("vllm", "org/model@v2 100%", 2, 1, "ab" * 16)
    text = key.to_string()
    assert text.count("@") == 4 and "/" not in text
    assert CacheKey.from_string(text) == key
    with pytest.raises(ValueError, match="5"):
        CacheKey.from_string("a@b")


def test_models_and_shards_never_share_keys() -> None:
    base = CacheKey("vllm", "m", 2, 0, "h")
    assert len({base, CacheKey("vllm", "m2", 2, 0, "h"), CacheKey("vllm", "m", 2, 1, "h"),
                CacheKey("vllm", "m", 4, 0, "h")}) == 4


@pytest.mark.parametrize("dtype", serde.SUPPORTED_DTYPES, ids=str)
def test_serde_roundtrip_bit_exact(dtype: torch.dtype) -> None:
    raw = torch.randint(0, 256, (3, 2, 5, 8), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    esize = torch.empty((), dtype=dtype).element_size()
    tensor = raw.view(dtype).view(3, 2, 5, 8 // esize)
    back = serde.decode(serde.encode(tensor, "vllm"))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))


def test_serde_rejects_corruption_truncation_and_garbage() -> None:
    data = bytearray(serde.encode(torch.randn(4, 4).to(torch.bfloat16)))
    flipped = bytearray(data)
    flipped[-1] ^= 0x01
    with pytest.raises(ChunkFormatError, match="checksum"):
        serde.decode(bytes(flipped))
    with pytest.raises(ChunkFormatError, match="truncated"):
        serde.decode(bytes(data[:-3]))
    with pytest.raises(ChunkFormatError, match="magic"):
        serde.decode(b"\x80\x04\x95" + bytes(60))  # a pickle stream is not a chunk
    with pytest.raises(ChunkFormatError):
        serde.decode(b"TKV")


@pytest.mark.parametrize("in_destination", [False, True])
def test_copy_payload_into_a_token_slice_is_exact_and_a_damaged_payload_is_refused(in_destination: bool) -> None:
    # a token slice of a [layers, 2, tokens, heads, dim] blob: several runs of 600 KiB, each
    # cut into steps of serde.VERIFY_STEP
    blob = torch.zeros(2, 2, 1024, 8, 128, dtype=torch.bfloat16)
    chunk = torch.randn(2, 2, 300, 8, 128).to(torch.bfloat16)
    data = serde.encode(chunk, "vllm")
    header = serde.decode_header(data)
    payload = memoryview(data)[header.header_len:]
    target = blob.narrow(2, 100, 300)
    assert serde.copy_payload_into(header, payload, target, in_destination=in_destination)
    assert torch.equal(target, chunk)
    assert not bool(blob.narrow(2, 0, 100).view(torch.int16).any()), "bytes outside the slice were written"
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x01
    target.zero_()
    with pytest.raises(ChunkFormatError, match="checksum mismatch"):
        serde.copy_payload_into(header, bytes(damaged), target, in_destination=in_destination)
    if not in_destination:
        assert not bool(target.view(torch.int16).any()), "verify-first must leave the destination untouched"
    with pytest.raises(ChunkFormatError, match="truncated"):
        serde.copy_payload_into(header, bytes(payload[:-2]), target, in_destination=in_destination)


@pytest.mark.parametrize("bad", [
    torch.tensor([5, -1, 7]),  # negative id, int64
    torch.tensor([5, -1, 7], dtype=torch.int32),
    torch.tensor([5, 2**31, 7]),  # one past the int32 range
    torch.tensor([2**40 + 3]),  # the low 32 bits alone would look valid
    np.array([1, -(2**62)], dtype=np.int64),
    [0, 2**31],
])
def test_token_ids_out_of_range_are_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2147483647\]"):
        as_token_array(bad)  # type: ignore[arg-type]


def test_every_integer_form_of_the_same_ids_gives_the_same_keys() -> None:
    ids = [0, 7, 2**31 - 1, 12345] * 8
    forms = [torch.tensor(ids), torch.tensor(ids, dtype=torch.int32), np.array(ids, dtype=np.int64),
             np.array(ids, dtype=np.uint32), ids, torch.tensor(ids)[::1]]
    maker = KeyMaker("vllm", "m", 1, 0, 8)
    expected = [key.to_string() for key in maker.iter_keys(as_token_array(forms[0]))]
    for form in forms[1:]:
        keys = list(KeyMaker("vllm", "m", 1, 0, 8).iter_keys(as_token_array(form)))
        assert [key.to_string() for key in keys] == expected
        # the string a key maker sets is the one the key itself would make
        assert [CacheKey(k.fmt, k.model_name, k.world_size, k.worker_id, k.chunk_hash, k.scope).to_string()
                for k in keys] == expected
    small = as_token_array(torch.tensor([1, 2, 255], dtype=torch.uint8))
    assert small.dtype == np.dtype("<i4") and small.tolist() == [1, 2, 255]
    with pytest.raises(ValueError, match="integer dtype"):
        as_token_array(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="integer dtype"):
        as_token_array(torch.tensor([True, False]))


@pytest.mark.parametrize("with_media", [False, True])
def test_tail_keys_are_the_keys_of_the_prompt_cut_there(with_media: bool) -> None:
    """The key of a partial chunk cut at n tokens, named without hashing the prefix again, is the
    last key of the prompt cut at n: what a save of that shorter prompt stored (media folded as
    the shorter prompt's keys fold them)."""
    from tierkv.chunks.identity import MediaSpan, RequestIdentity

    identity = RequestIdentity(media=(MediaSpan("image-a", 40, 20),)) if with_media else RequestIdentity()
    maker = KeyMaker("vllm", "m", 1, 0, chunk_size=32, engine_parts=(("revision", "r1"),))
    tokens = as_token_array(np.arange(1, 101))
    lengths = [31, 16, 1]
    tails = maker.tail_keys(tokens, 1, lengths, identity)
    assert tails == [list(maker.iter_keys(tokens[: 32 + n], identity))[-1] for n in lengths]
    assert len(set(tails)) == 3 and tails[0] != list(maker.iter_keys(tokens, identity))[1]
    assert maker.tail_keys(tokens, 0, [5], identity) == [list(maker.iter_keys(tokens[:5], identity))[-1]]
    for bad in (0, 33):
        with pytest.raises(ValueError, match="tail lengths must lie in"):
            maker.tail_keys(tokens, 1, [bad], identity)
    with pytest.raises(ValueError, match="end within the 100 tokens"):
        maker.tail_keys(tokens, 3, [8], identity)
