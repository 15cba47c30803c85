#!/usr/bin/env bash
# Download, on a machine with a package index, the pure-Python wheels that the GPU machine lacks,
# so that they travel with the working tree (the GPU machine has no package index). Competitors are benchmarked at the versions the reference
# anchors were measured with: liger-kernel 0.8.5 (current) and 0.4.2 (the seed pages' version),
# cut-cross-entropy 25.1.1. The two liger versions go to separate folders because they cannot be
# installed side by side; device_common.sh's install_wheels puts each into its own --target.
# --no-deps on purpose: their declared dependencies (torch, triton, transformers) are already on the
# GPU machine, and resolving them here would download multi-GB CUDA builds of torch.
# Usage: scripts/fetch_wheels.sh            (run from anywhere; writes <repo>/.whl/)
#        scripts/fetch_wheels.sh --quack    (also QuACK 0.6.5 and its CuTe DSL 4.7.1, as .whl/qa and .whl/qb)
#        scripts/fetch_wheels.sh --trl      (also TRL 1.16.0 and what the GPU image lacks or holds at another
#                                            version, as .whl/trl, ~16 MiB: scripts/gpu_train_dpo.sh carries it)
# QuACK's CUDA library wheel (nvidia-cutlass-dsl-libs-cu13 4.7.1, 88 MB) is more than one device call carries:
# --quack unpacks it, packs it as tar.xz (~61 MiB; xz takes a few minutes) and cuts that in two, cu13.part.aa and
# cu13.part.ab, sized so that .whl/qa (part aa and the small wheels, ~14 MiB of them) and .whl/qb (part ab) weigh the
# same, ~37 MiB each: with the ~22 MiB working tree each stays under a call's 64 MiB. A first device call carries qa,
# a second one on the same warm machine qb, and `install_quack` (scripts/device_common.sh) joins them.
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

if [ "${1:-}" = "--trl" ]; then
    # the image has accelerate 1.15 and transformers 5.17, pyarrow and xxhash, but not trl, datasets, dill or
    # multiprocess; the versions requirements.txt pins, so the GPU row runs what CI tested. transformers 5.25
    # refuses the image's huggingface-hub 1.33 at import (needs >=2.4,<3), so hub 2.4 and what it needs beyond
    # the image (its HTTP client httpx2 and the rest of the CPU venv's resolution) travel too
    for spec in trl==1.16.0 datasets==5.2.0 transformers==5.25.0 accelerate==1.16.0 dill==0.4.1 \
                multiprocess==0.70.19 huggingface_hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 hf-xet==1.8.0 \
                click==8.5.1 truststore==0.10.5 anyio==4.16.0 idna==3.21 h11==0.16.0; do
        download "$dest/trl" "$spec"
    done
fi

if [ "${1:-}" = "--quack" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # quack-kernels 0.6.5's own requirements besides torch (nvidia-cutlass-dsl >= 4.7, apache-tvm-ffi, the DLPack
    # extension, einops); the DSL's libs need libs-core (without it the DSL's `cutlass.cutlass_dsl` is missing) and
    # nvidia-cuda-nvdisasm >= 13.3 (its wheel holds only nvidia/cu13/bin/nvdisasm, no package __init__). cuda-python
    # and protobuf, which the DSL also needs, are on the GPU image (`pip show` them before a measuring call)
    for spec in quack-kernels==0.6.5 nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1 \
                nvidia-cutlass-dsl-libs-core==4.7.1 "apache-tvm-ffi>=0.1.6,<0.2" torch-c-dlpack-ext einops \
                "nvidia-cuda-nvdisasm>=13.3,<14"; do
        download "$work/small" "$spec"
    done
    download "$work/big" nvidia-cutlass-dsl-libs-cu13==4.7.1
    mkdir -p "$work/unpacked" "$dest/qa" "$dest/qb"
    python3 -m zipfile -e "$work"/big/*.whl "$work/unpacked"
    tar c -C "$work/unpacked" . | xz -6 -T0 > "$work/cu13.tar.xz"
    small=$(cat "$work"/small/*.whl | wc -c)
    size=$(stat -c %s "$work/cu13.tar.xz")
    first=$(( (small + size) / 2 - small ))
    [ "$first" -gt 0 ] || first=1
    head -c "$first" "$work/cu13.tar.xz" > "$work/cu13.part.aa"
    tail -c +"$((first + 1))" "$work/cu13.tar.xz" > "$work/cu13.part.ab"
    rm -f "$dest"/qa/* "$dest"/qb/*
    cp "$work"/small/*.whl "$work/cu13.part.aa" "$dest/qa/"
    cp "$work/cu13.part.ab" "$dest/qb/"
    du -sh "$dest/qa" "$dest/qb"
fi

# Keep the wheels out of git without touching the shared .gitignore.
exclude="$repo/.git/info/exclude"
if [ -d "$repo/.git" ] && ! grep -qxF '/.whl/' "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")"
    echo '/.whl/' >> "$exclude"
fi

find "$dest" -type f -name '*.whl' | sort
