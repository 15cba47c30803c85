# Sourced by the GPU-machine drivers (h200_*.sh): the steps every one of them starts with.
#   device_setup OUTDIR         OUTDIR made absolute (in $outdir), the repository in $repo and the working
#                               directory, unbuffered Python, $start for elapsed times, $failures
#   install_wheels SITE DIR...  the carried wheels of every existing DIR (e.g. .whl/liger085) into SITE,
#                               then SITE and the repository on PYTHONPATH (the machine has no package index)

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
