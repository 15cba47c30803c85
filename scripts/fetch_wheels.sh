#!/usr/bin/env bash
# Download, on a machine with a package index, the pure-Python wheels that the GPU machine lacks,
# so that they travel with the working tree (the GPU machine has no package index). Competitors are benchmarked at the versions the reference
# anchors were measured with: liger-kernel 0.8.5 (current) and 0.4.2 (the seed pages' version),
# cut-cross-entropy 25.1.1. The two liger versions go to separate folders because they cannot be
# installed side by side; scripts/h200_measure.sh installs each into its own --target.
# --no-deps on purpose: their declared dependencies (torch, triton, transformers) are already on the
# GPU machine, and resolving them here would download multi-GB CUDA builds of torch.
# Usage: scripts/fetch_wheels.sh            (run from anywhere; writes <repo>/.whl/)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo/.whl"

download() {  # download DIR NAME==VERSION: a wheel usable by CPython 3.12 on manylinux x86_64
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$1" "$2"
}

download "$dest/liger085" liger-kernel==0.8.5
download "$dest/liger042" liger-kernel==0.4.2
download "$dest/cce" cut-cross-entropy==25.1.1

# Keep the wheels out of git without touching the shared .gitignore.
exclude="$repo/.git/info/exclude"
if [ -d "$repo/.git" ] && ! grep -qxF '/.whl/' "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")"
    echo '/.whl/' >> "$exclude"
fi

find "$dest" -type f -name '*.whl' | sort
