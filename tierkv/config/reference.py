"""The configuration reference, generated from the declarations: every top-level key, every
key a tier takes, every option of each section and of each built-in backend, with its type,
default and description.

The sections' and backends' options are the ``tierkv.backend.options.Option`` maps
the loader validates with; the top-level and common tier keys, which the loader parses by
hand, are declared in ``TOP_LEVEL`` and ``TIER_KEYS`` here. docs/reference.md is this
module's output (``python -m tierkv.config.reference > docs/reference.md``) and a docs test
compares the two, so an option added without a description, or a reference left behind,
fails the suite.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from tierkv.backend import registry
from tierkv.backend.options import Option, format_size
from tierkv.config import loader
from tierkv.config.tier_config import TIER_COMMON

# key -> (type, default, description) for what the loader parses by hand
TOP_LEVEL: dict[str, tuple[str, str, str]] = {
    "model": ("string", "required (an integration fills in the served model)",
              "the model every key binds; `tierkv.Engine` needs it in the config"),
    "model_revision": ("string", "none (an integration derives one)",
                       "the model's revision (a commit, a digest) bound into every key"),
    "chunk_size": ("int", "256", "tokens per chunk: the unit stored, looked up and loaded"),
    "kv_format": ("`vllm` or `huggingface`", "`vllm`", "the layout of the KV tensors handed to the engine"),
    "dtype": ("a torch dtype name", "none (the stored tensors')", "the KV dtype, when known in advance"),
    "write_policy": ("`write_through` or `write_back`", "`write_through`",
                     "whether a put is written down to every tier at once, or the lower tiers are filled later"),
    "world_size": ("int", "1", "ranks sharing the model (tensor x pipeline parallel); in every key"),
    "worker_id": ("int", "0", "this rank, below `world_size`; in every key"),
    "tiers": ("list of tiers", "required", "the tiers, fastest first (the keys each takes: below)"),
    "pressure": ("mapping", "the defaults below", "memory-pressure watermarks that shrink the memory tiers"),
    "background": ("mapping", "the defaults below", "the queue of fills to the lower tiers"),
    "health": ("mapping", "the defaults below", "when a failing tier is skipped, and for how long"),
    "recompute": ("`{tokens_per_s: N}` or `{curve: [[tokens, tokens_per_s], ...]}`", "none",
                  "how fast the serving model prefills: the cost model loads a prefix only where that is faster"),
    "cost_aware": ("bool or null", "null (true once a recompute speed is known)",
                   "load a cached prefix only as far as it beats recomputing it"),
}
TIER_KEYS: dict[str, tuple[str, str, str]] = {
    "name": ("string", "required", "the tier's name, unique in the config (in logs, metrics and errors)"),
    "backend": ("string", "required", "an installed backend (`tierkv backends`), or `distribution:backend`"),
    "capacity": ("size (`4GiB`, `500MB`)", "required by memory tiers", "the most bytes the tier holds"),
    "promote": ("bool", "true", "copy hits from the tiers below up into this tier"),
    "admission": ("`all`, `reused(n)`, `tinylfu`", "`tinylfu` below the top tier, else `all`",
                  "which chunks a lower tier takes"),
    "codec": ("`none`, `lz4`, `zstd`, `auto`, `fp8`", "`none`", "how a byte tier keeps its chunks"),
}
SECTIONS: dict[str, Mapping[str, Option]] = {
    "pressure": loader._PRESSURE_OPTIONS,
    "background": loader._BACKGROUND_OPTIONS,
    "health": loader._HEALTH_OPTIONS,
}


def _kind(option: Option) -> str:
    kind = option.kind if isinstance(option.kind, str) else getattr(option.kind, "__name__", "value")
    if option.choices:
        return " or ".join(f"`{choice}`" for choice in option.choices)
    return str(kind)


def _default(option: Option) -> str:
    if option.required:
        return "required"
    if option.default is None:
        return "none"
    if option.kind == "size" and isinstance(option.default, int):
        return format_size(option.default)
    if isinstance(option.default, bool):
        return "true" if option.default else "false"
    show = getattr(option.kind, "show", None)  # a kind that renders its values (a file mode in octal)
    return f"`{show(option.default) if callable(show) else option.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(doc)} |" for key, kind, default, doc in rows]
    return lines


def _options(options: Mapping[str, Option]) -> list[tuple[str, str, str, str]]:
    return [(name, _kind(option), _default(option), option.doc or "") for name, option in options.items()]


def built_in_backends() -> dict[str, type]:
    """This distribution's backends, by name (plugins document themselves)."""
    found = {}
    for name, claims in registry.installed().items():
        for info in claims:
            if registry.normalize_distribution(info.distribution) == registry.DISTRIBUTION:
                found[name] = registry.load(info.qualified_name)
    return dict(sorted(found.items()))


def reference_markdown() -> str:
    """docs/reference.md, from the declarations."""
    lines = ["# Configuration reference", "",
             "Generated from the declarations (`python -m tierkv.config.reference > docs/reference.md`; a docs",
             "test fails when this page and the code differ). The guide to these keys, with examples:",
             "[Configuration and tiers](configuration.md).", "", "## Top-level keys", ""]
    lines += _table([(key, *TOP_LEVEL[key]) for key in TOP_LEVEL])
    for section, options in SECTIONS.items():
        lines += ["", f"## `{section}`", ""] + _table(_options(options))
    lines += ["", "## Keys every tier takes", ""] + _table([(key, *TIER_KEYS[key]) for key in TIER_KEYS])
    for name, backend in built_in_backends().items():
        lines += ["", f"## Backend `{name}`", ""]
        summary = (backend.__doc__ or "").strip().split("\n\n")[0]
        if summary:
            lines += [" ".join(summary.split()), ""]
        options = dict(getattr(backend, "options", {}))
        lines += _table(_options(options)) if options else ["No options of its own."]
    return "\n".join(lines) + "\n"


def undocumented() -> list[str]:
    """Keys the loader or a built-in backend accepts that this reference does not describe."""
    missing = [f"top-level {key}" for key in loader._TOP_LEVEL if key not in TOP_LEVEL]
    missing += [f"tier key {key}" for key in TIER_COMMON if key not in TIER_KEYS]
    missing += [f"{section}.{name}" for section, options in SECTIONS.items()
                for name, option in options.items() if not option.doc.strip()]
    missing += [f"backend {backend}: option {name}" for backend, cls in built_in_backends().items()
                for name, option in getattr(cls, "options", {}).items() if not option.doc.strip()]
    return missing


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
