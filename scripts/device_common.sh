# Sourced by the GPU-machine drivers (h200_*.sh): the steps every one of them starts with.
#   device_setup OUTDIR         OUTDIR made absolute (in $outdir), the repository in $repo and the working
#                               directory, unbuffered Python, USE_HUB_KERNELS=NO, $start for elapsed times,
#                               $failures
#   install_wheels SITE DIR...  the carried wheels of every existing DIR (e.g. .whl/liger085) into SITE,
#                               then SITE and the repository on PYTHONPATH (the machine has no package index)
#   install_quack               QuACK 0.6.5 from the carried parts (.whl/qa, .whl/qb) onto PYTHONPATH ($quack_path)
#   triton_cache_restore DIR    TRITON_CACHE_DIR=DIR (created empty) with autotune results cached too; if the
#                               carried TRITON_CACHE_TARBALL exists, its kernels are unpacked into DIR first
#   run_shuffled LOG PREFIX CAP_S TAIL "IMPLS" CMD...
#                               each implementation of the space-separated IMPLS in a shuffled order, one process
#                               each (so each peak memory is its own): `CMD... --loss-impl IMPL` under a CAP_S-second
#                               timeout, its output in $outdir/PREFIX_IMPL.log; the order, each command, the last TAIL
#                               lines of its output (but "train:" progress lines) and its exit status go to LOG;
#                               a failing IMPL joins $failures
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
    # transformers 5.25's from_pretrained turns use_kernels on by default and raises without the `kernels`
    # package, which the image lacks (and the Hub it fetches from is unreachable): the layers stay PyTorch's
    export USE_HUB_KERNELS=NO
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

install_quack() {
    # QuACK and its CuTe DSL from the carried parts (scripts/fetch_wheels.sh --quack: .whl/qa and .whl/qb, over
    # two calls on one warm machine; parts gathered in $TMPDIR/quack_parts). The wheels go into an empty target
    # first, then the cu13 files: pip --target --upgrade replaces the nvidia_cutlass_dsl folder, so cu13 files
    # unpacked before it are lost ("No CTK flavor installed"). The target's path contains /site-packages/: QuACK
    # 0.6.5 fingerprints every epilogue function whose file is not under a site-packages folder, and refuses them all
    # ("epilogue fn depends on ... no fail-closed semantic key") when installed anywhere else. The DSL's .pth is not
    # run under --target, so its packages folder joins PYTHONPATH by hand. Sets $quack_path (empty when the parts are
    # incomplete).
    local parts_dir="${TMPDIR:-/tmp}"/quack_parts qsite="${TMPDIR:-/tmp}"/quack/site-packages d
    mkdir -p "$parts_dir"
    for d in .whl/qa .whl/qb; do [ -d "$d" ] && cp "$d"/* "$parts_dir"/; done
    quack_path=""
    if [ -f "$parts_dir/cu13.part.aa" ] && [ -f "$parts_dir/cu13.part.ab" ]; then
        rm -rf "$qsite" && mkdir -p "$qsite"
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$qsite" "$parts_dir"/*.whl \
            && cat "$parts_dir"/cu13.part.* | xz -d | tar x -C "$qsite" \
            && quack_path="$qsite:$qsite/nvidia_cutlass_dsl/dsl_packages"
    fi
    if [ -n "$quack_path" ]; then export PYTHONPATH="$quack_path${PYTHONPATH:+:$PYTHONPATH}"; fi
}

run_shuffled() {
    local log="$1" prefix="$2" cap="$3" tail_lines="$4" impls order impl t0 status
    read -r -a impls <<< "$5"
    shift 5
    mapfile -t order < <(python3 -c "import random, sys; l = sys.argv[1:]; random.shuffle(l); print(*l, sep='\n')" \
        "${impls[@]}")
    echo "order: ${order[*]}" | tee -a "$log"
    for impl in "${order[@]}"; do
        t0=$SECONDS
        echo "== $impl (cap $cap s): $* --loss-impl $impl" | tee -a "$log"
        timeout -k 10 "$cap" "$@" --loss-impl "$impl" > "$outdir/${prefix}_$impl.log" 2>&1
        status=$?
        grep -v '^train:' "$outdir/${prefix}_$impl.log" | tail -n "$tail_lines" | tee -a "$log"
        echo "== $impl: exit $status after $((SECONDS - t0)) s (total $((SECONDS - start)) s)" | tee -a "$log"
        [ "$status" -eq 0 ] || failures+=("$impl:$status")
    done
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
