#!/usr/bin/env bash
# Download the wheels that benchmarks/gpu_check.py needs on the GPU machine and cannot get there.
#
# The device image (torch + CUDA, nvcc, ninja, pytest, pytest-timeout, numpy, pyyaml, aiofiles,
# xxhash, nvidia-ml-py, prometheus-client) has no network. Of tierkv's runtime dependencies
# (pyproject.toml) only lmdb is missing; the tests the check runs import nothing else that is not
# there. This fetches lmdb's manylinux x86_64 wheels for the Python versions the image may have
# (3.10 to 3.14) into benchmarks/gpu_wheels/, where the check installs the matching one from
# (no registry). Run it on a machine with PyPI access: bash scripts/gpu_wheels.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/benchmarks/gpu_wheels"
python="${PYTHON:-python3}"
# the same lmdb as the test environment, so the device runs what CI runs
packages=("lmdb==3.0.0")
versions=("3.10" "3.11" "3.12" "3.13" "3.14")

mkdir -p "$dest"
for version in "${versions[@]}"; do
    "$python" -m pip download --quiet --only-binary=:all: --no-deps --dest "$dest" \
        --python-version "$version" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        "${packages[@]}"
done
ls -l "$dest"
du -sh "$dest"
