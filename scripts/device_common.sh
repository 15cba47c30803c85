# Sourced by the GPU-machine drivers (h200_*.sh): the steps every one of them starts with.
#   device_setup OUTDIR         OUTDIR made absolute (in $outdir), the repository in $repo and the working
#                               directory, unbuffered Python, $start for elapsed times, $failures
#   install_wheels SITE DIR...  the carried wheels of every existing DIR (e.g. .whl/liger085) into SITE,
#                               then SITE and the repository on PYTHONPATH (the machine has no package index)
#   triton_cache_restore DIR    TRITON_CACHE_DIR=DIR (created empty) with autotune results cached too; if the
#                               carried TRITON_CACHE_TARBALL exists, its kernels are unpacked into DIR first
#   triton_cache_save DIR FILE  DIR's compiled kernels and autotune results packed into FILE (tar.xz, for
#                               $OUT), without the intermediate IRs: what a later call carries back
#
# The Triton cache travels between device calls: a call ends with `triton_cache_save "$TRITON_CACHE_DIR"
# "$OUT/triton_cache.tar.xz"`; copy that file to $TRITON_CACHE_TARBALL (.triton_cache/triton_cache.tar.xz,
# ignored by git: `echo /.triton_cache/ >> .git/info/exclude`) and name .triton_cache in the next call's carry.
TRITON_CACHE_TARBALL=.triton_cache/triton_cache.tar.xz

device_setup() {
    repo="$(cd "$(dirname "${BASH_SOURCE[1]}")/.." && pwd)"
    mkdir -p "$1" && outdir="$(cd "$1" && pwd)"
    cd "$repo" || exit 1
    export PYTHONUNBUFFERED=1
    start=$SECONDS
    failures=()
}

install_wheels() {
    local site="$1" wheels=() dir
    shift
    for dir in "$@"; do
        [ -d "$dir" ] && wheels+=("$dir"/*.whl)
    done
    [ ${#wheels[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target "$site" "${wheels[@]}"
    export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
}

triton_cache_restore() {
    rm -rf "$1" && mkdir -p "$1"
    export TRITON_CACHE_DIR="$1" TRITON_CACHE_AUTOTUNING=1
    if [ -f "$repo/$TRITON_CACHE_TARBALL" ]; then
        tar xJf "$repo/$TRITON_CACHE_TARBALL" -C "$1" && \
            echo "triton cache: $(find "$1" -name '*.cubin' | wc -l) kernels restored from $TRITON_CACHE_TARBALL"
    else
        echo "triton cache: cold (no $TRITON_CACHE_TARBALL carried)"
    fi
}

triton_cache_save() {
    # the cubins, their metadata and launchers, and the autotune timings; not the IRs they were lowered through
    tar cf - -C "$1" --exclude='*.llir' --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.source' \
        --exclude='*.ptx' . | xz -6 -T0 > "$2"
    echo "triton cache: $(find "$1" -name '*.cubin' | wc -l) kernels packed into $2 ($(du -h "$2" | cut -f1))"
}
