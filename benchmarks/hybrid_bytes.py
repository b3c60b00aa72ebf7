"""Hybrid and MLA models: bytes stored per cached token, bytes and time per hit, against a cache
that keeps every layer's full prefix (hybrid), a GQA model of the same depth (MLA) and a per-rank
cache at tensor parallelism 2 (MLA).

For each model kind (layer mixes and geometries of served models, with fewer layers in the
same proportions so the run fits a small machine), a prompt is saved through the connector's
hybrid path (``tierkv.integrations.vllm_v1.hybrid.scheduler`` and ``.worker``: one
save job per step, the steps vLLM would run) into a ``cpu`` tier, then a hit of the whole
prompt is loaded into other blocks, ``--repeats`` times. The baseline, timed in the same run
on the same engine, is what a cache without the hybrid manager keeps: every layer as a
full-attention layer of the model's attention geometry, the KV of every token of the prefix,
all of it loaded on a hit (vLLM turns sliding-window layers into full attention when its
hybrid manager is off; a Mamba layer has no such form, so for those kinds the baseline is a
model of the same depth whose every layer is attention, what a pure-attention cache of that
size stores).

MLA (DeepSeek V3's latent: 512 + 64 values per token and layer, bf16) goes through the
one-group worker (``tierkv.integrations.vllm_v1.worker``, the ``mla`` layout) into a ``shm``
pool: a save, then a hit loaded into other blocks; its baseline in the same run is a GQA model
of the same depth whose KV is 8 heads of 128 (Llama 3 70B's). At TP 2 both ranks hold the same
latent: tierkv's keys bind no TP rank and rank 0 alone saves, against a per-rank cache (keys
bound to the rank, as for a GQA model's shards) where both ranks save their copy: pool bytes
per token, and the time both ranks' saves take.

    python benchmarks/hybrid_bytes.py [--tokens 4096] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierkv import Engine
from tierkv.chunks.identity import PLAIN
from tierkv.integrations.vllm_v1.hybrid.groups import KVGroup
from tierkv.integrations.vllm_v1.hybrid.scheduler import HybridLoad, HybridPlanner
from tierkv.integrations.vllm_v1.hybrid.state_pages import content_bytes
from tierkv.integrations.vllm_v1.hybrid.worker import HybridTransfers, bind_groups
from tierkv.integrations.vllm_v1.scheduler import LoadSpec, LookupResult, SaveSpec
from tierkv.integrations.vllm_v1.worker import WorkerTransfers, _GuardedSink

BLOCK, CHUNK = 256, 256


@dataclass(frozen=True)
class Kind:
    """A model kind: its layer mix (in order of vLLM's groups) and geometry."""

    name: str
    like: str
    heads: int
    head_size: int
    sliding: int = 0  # sliding-window layers (window ``window``)
    window: int = 0
    full: int = 1
    mamba: int = 0  # recurrent-state layers, each a state of ``state_shapes``
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()

    def groups(self) -> list[KVGroup]:
        """vLLM's groups for this mix: layers of one kind share a group."""
        groups, index, layer = [], 0, 0
        for kind, count in (("sliding", self.sliding), ("mamba", self.mamba), ("full", self.full)):
            if not count:
                continue
            names = tuple(f"layer.{layer + i}" for i in range(count))
            layer += count
            groups.append(KVGroup(index, kind, names, BLOCK, window=self.window if kind == "sliding" else 0,
                                  state_shapes=self.state_shapes if kind == "mamba" else (),
                                  state_dtypes=self.state_dtypes if kind == "mamba" else (),
                                  state_type="MAMBA2" if kind == "mamba" else "", num_kv_heads=self.heads,
                                  head_size=self.head_size))
            index += 1
        return groups

    @property
    def layers(self) -> int:
        return self.sliding + self.full + self.mamba


KINDS = [
    Kind("sliding 5:1, window 1024", "Gemma 3 (5 local : 1 global)", heads=8, head_size=128, sliding=5, window=1024),
    Kind("sliding 1:1, window 128", "gpt-oss (alternating)", heads=8, head_size=64, sliding=1, window=128),
    Kind("Gated DeltaNet 3:1", "Qwen3-Next (3 linear : 1 full)", heads=2, head_size=256, mamba=3,
         state_shapes=((3, 8192), (32, 128, 128)), state_dtypes=("torch.bfloat16", "torch.float32")),
    Kind("Mamba2 + attention", "Nemotron-H (mostly Mamba2)", heads=8, head_size=128, mamba=5,
         state_shapes=((3, 10240), (128, 64, 128)), state_dtypes=("torch.bfloat16", "torch.float32")),
]


def caches(groups: list[KVGroup], blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """CPU-layout attention pages and raw state pages for every layer of ``groups``."""
    generator = torch.Generator().manual_seed(seed)
    made = {}
    for group in groups:
        for name in group.layer_names:
            if group.kind == "mamba":
                page = content_bytes(group.state_shapes, group.state_dtypes)
                made[name] = torch.randint(-100, 100, (blocks, page), dtype=torch.int8, generator=generator)
            else:
                shape = (blocks, group.num_kv_heads, BLOCK, 2 * group.head_size)
                made[name] = torch.randint(-100, 100, shape, dtype=torch.int16, generator=generator).view(
                    torch.bfloat16)
    return made


def step_output(req_id: str, computed: int, scheduled: int, tables: tuple[list[int], ...]) -> Any:
    from types import SimpleNamespace

    new = [SimpleNamespace(req_id=req_id, num_computed_tokens=computed)] if computed == 0 else []
    cached = SimpleNamespace(req_ids=[] if new else [req_id], num_computed_tokens=[] if new else [computed])
    return SimpleNamespace(num_scheduled_tokens={req_id: scheduled}, scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           kv_connector_block_state=SimpleNamespace(get_block_ids=lambda _: tables))


def measure(groups: list[KVGroup], tokens: int, repeats: int) -> dict[str, float]:
    """Save a prompt of ``tokens`` (one save job per BLOCK-token step), then load its whole
    hit ``repeats`` times: bytes stored per token, bytes and median seconds per hit."""
    blocks_per_prompt = tokens // BLOCK + 1
    blocks = 2 * blocks_per_prompt + 2
    source, target = caches(groups, blocks, 1), caches(groups, blocks, 2)
    prompt = np.arange(1, tokens + 2, dtype=np.int64)  # one token past the hit: never the whole prompt
    tables = tuple(list(range(1, blocks_per_prompt + 1)) for _ in groups)
    load_tables = tuple(list(range(blocks_per_prompt + 1, 2 * blocks_per_prompt + 1)) for _ in groups)
    config = {"model": "hybrid-bytes", "chunk_size": CHUNK, "tiers": [{"name": "host", "backend": "cpu",
                                                                       "capacity": "2GiB"}]}
    with Engine(config) as engine:
        saver = HybridTransfers(engine, bind_groups(groups, source, "cpu", 0, 0, BLOCK), CHUNK, BLOCK, Counter(),
                                _GuardedSink, 60.0)
        planner = HybridPlanner(groups, lambda *_: LookupResult(0, 0), chunk=CHUNK, block_size=BLOCK)
        planner.matched_tokens("r", prompt.tolist(), 0)
        for computed in range(0, tokens, BLOCK):
            for save in planner.build(step_output("r", computed, BLOCK, tables)).saves:
                saver.save(save)
            saver.wait_for_saves(120)
        stored = sum(tier.used_bytes for tier in engine.tiers)
        loader = HybridTransfers(engine, bind_groups(groups, target, "cpu", 0, 0, BLOCK), CHUNK, BLOCK, Counter(),
                                 _GuardedSink, 60.0)
        hit = loader.lookup(prompt, PLAIN).cached_tokens
        if hit != tokens:
            raise RuntimeError(f"the hit is {hit} tokens, expected the {tokens} saved")
        seconds = []
        for attempt in range(repeats):
            load_planner = HybridPlanner(groups, loader.lookup, chunk=CHUNK, block_size=BLOCK)
            req = f"load{attempt}"
            load_planner.matched_tokens(req, prompt.tolist(), 0)
            load_planner.after_alloc(req, _window_tables(groups, load_tables, hit), hit)
            (load,) = load_planner.build(step_output(req, 0, 1, load_tables)).loads
            started = time.perf_counter()
            ok = _load(loader, load)
            seconds.append(time.perf_counter() - started)
            if not ok:
                raise RuntimeError("a load of the hit failed")
        loaded = sum(_part_bytes(groups, part) for part in load.parts)
    return {"stored_bytes_per_token": stored / tokens, "loaded_bytes_per_hit": loaded,
            "load_s": statistics.median(seconds)}


def _window_tables(groups: list[KVGroup], tables: tuple[list[int], ...], hit: int) -> tuple[list[int], ...]:
    """vLLM's allocation for a hit: a sliding group's blocks below its window are the null block."""
    result = []
    for group, table in zip(groups, tables):
        if group.kind == "sliding":
            first = max(0, hit - group.window_tokens()) // BLOCK
            table = [0] * first + table[first:]
        elif group.kind == "mamba":
            table = [0] * ((hit - 1) // BLOCK) + table[(hit - 1) // BLOCK:]
        result.append(table)
    return tuple(result)


def _part_bytes(groups: list[KVGroup], part: Any) -> int:
    group = groups[part.group]
    if group.kind == "mamba":
        return len(group.layer_names) * content_bytes(group.state_shapes, group.state_dtypes)
    return len(group.layer_names) * (part.end - part.start) * 2 * group.num_kv_heads * group.head_size * 2


def _load(loader: HybridTransfers, load: HybridLoad) -> bool:
    loader.start_load(load)
    loader._loads[load.req_id][1].result(120)
    over, failed = loader.finished(set())
    return load.req_id in over and not failed


MLA_LAYERS, LATENT, GQA_HEADS, GQA_HEAD = 8, 576, 8, 128


def _pool_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return f"{base}/tierkv-bench-mla-{uuid.uuid4().hex[:12]}.pool"


def _one_group_caches(layout: str, blocks: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (blocks, BLOCK, LATENT) if layout == "mla" else (blocks, GQA_HEADS, BLOCK, 2 * GQA_HEAD)
    return [torch.randint(-100, 100, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)
            for _ in range(MLA_LAYERS)]


def measure_one_group(layout: str, tokens: int, repeats: int, ranks: int = 1, per_rank_keys: bool = False
                      ) -> dict[str, float]:
    """``ranks`` workers (one engine each, as vLLM's TP ranks) over one shm pool save a prompt of
    ``tokens`` (every rank, or with ``per_rank_keys`` False and more than one rank, rank 0 alone:
    tierkv's MLA rule), then rank 0 loads the hit into other blocks ``repeats`` times: pool bytes
    per token, the saves' seconds, the median load."""
    from tierkv.engine import EngineMetadata

    heads, head_size = (1, LATENT) if layout == "mla" else (GQA_HEADS, GQA_HEAD)
    blocks_per_prompt = tokens // BLOCK + 1
    blocks = 2 * blocks_per_prompt + 2
    prompt = np.arange(1, tokens + 2, dtype=np.int64)
    pool = _pool_path()
    config = {"model": "mla-bytes", "chunk_size": CHUNK,
              "tiers": [{"name": "node", "backend": "shm", "path": pool, "capacity": "2GiB"}]}
    engines, workers = [], []
    try:
        for rank in range(ranks):
            key_rank, key_world = (rank, ranks) if per_rank_keys else (0, 1)
            engine = Engine(config, EngineMetadata("mla-bytes", key_world, key_rank, "vllm"))
            worker = WorkerTransfers(engine)
            worker.register(_one_group_caches(layout, blocks, rank + 1), layout, heads, head_size, BLOCK, BLOCK)
            if rank > 0 and not per_rank_keys:
                worker.saves_elsewhere = "rank 0 saves"
            engines.append(engine)
            workers.append(worker)
        table = tuple(range(1, blocks_per_prompt + 1))
        started = time.perf_counter()
        for worker in workers:
            worker.save(SaveSpec("save", prompt, table))
        for worker in workers:
            worker.wait_for_saves(["save"])
        save_s = time.perf_counter() - started
        stored = engines[0].tiers[0].used_bytes
        load_table = tuple(range(blocks_per_prompt + 1, 2 * blocks_per_prompt + 1))
        seconds = []
        for attempt in range(repeats):
            started = time.perf_counter()
            if not workers[0].load(LoadSpec(f"load{attempt}", prompt, load_table, 0, tokens)):
                raise RuntimeError("a load of the hit failed")
            seconds.append(time.perf_counter() - started)
    finally:
        for engine in engines:
            engine.close()
        if os.path.exists(pool):
            os.unlink(pool)
    return {"stored_bytes_per_token": stored / tokens, "save_s": save_s, "load_s": statistics.median(seconds)}


def mla_rows(tokens: int, repeats: int) -> list[dict[str, Any]]:
    """MLA against a GQA model of the same depth (one rank), and at TP 2 against a per-rank cache."""
    rows = []
    mla, gqa = measure_one_group("mla", tokens, repeats), measure_one_group("cpu", tokens, repeats)
    rows.append({"kind": "MLA", "like": "DeepSeek V3 latent (512 + 64)", "mla": mla, "baseline": gqa,
                 "baseline_is": f"GQA, {GQA_HEADS} KV heads of {GQA_HEAD}"})
    once = measure_one_group("mla", tokens, repeats, ranks=2)
    per_rank = measure_one_group("mla", tokens, repeats, ranks=2, per_rank_keys=True)
    rows.append({"kind": "MLA, TP 2", "like": "DeepSeek V3 latent, 2 ranks", "mla": once, "baseline": per_rank,
                 "baseline_is": "per-rank keys, every rank saves"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="the cached prefix (a multiple of 256)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    rows = []
    print(f"prefix {args.tokens} tokens, chunk {CHUNK}, cpu tier; baseline: every layer full attention, "
          "its whole prefix stored and loaded")
    print(f"{'kind':28} {'like':32} {'B/token':>10} {'vs full':>8} {'hit MiB':>8} {'vs full':>8} {'load ms':>8} "
          f"{'vs full':>8}")
    for kind in KINDS:
        hybrid = measure(kind.groups(), args.tokens, args.repeats)
        everything = Kind(kind.name, kind.like, kind.heads, kind.head_size, full=kind.layers)
        baseline = measure(everything.groups(), args.tokens, args.repeats)
        row = {"kind": kind.name, "like": kind.like, "hybrid": hybrid, "full_prefix": baseline}
        rows.append(row)
        print(f"{kind.name:28} {kind.like:32} {hybrid['stored_bytes_per_token']:10.0f} "
              f"{hybrid['stored_bytes_per_token'] / baseline['stored_bytes_per_token']:8.2f} "
              f"{hybrid['loaded_bytes_per_hit'] / 2**20:8.1f} "
              f"{hybrid['loaded_bytes_per_hit'] / baseline['loaded_bytes_per_hit']:8.2f} "
              f"{hybrid['load_s'] * 1e3:8.1f} {hybrid['load_s'] / baseline['load_s']:8.2f}")
    print(f"\nMLA, one-group path, shm pool, {MLA_LAYERS} layers; baseline in the same run as named")
    print(f"{'kind':28} {'baseline':32} {'B/token':>10} {'vs base':>8} {'save ms':>8} {'vs base':>8} {'load ms':>8} "
          f"{'vs base':>8}")
    for row in mla_rows(args.tokens, args.repeats):
        rows.append(row)
        mla, base = row["mla"], row["baseline"]
        print(f"{row['kind']:28} {row['baseline_is']:32} {mla['stored_bytes_per_token']:10.0f} "
              f"{mla['stored_bytes_per_token'] / base['stored_bytes_per_token']:8.2f} {mla['save_s'] * 1e3:8.1f} "
              f"{mla['save_s'] / base['save_s']:8.2f} {mla['load_s'] * 1e3:8.1f} {mla['load_s'] / base['load_s']:8.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
