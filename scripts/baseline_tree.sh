#!/usr/bin/env bash
# The package of an earlier commit, renamed fusedkern_base, so that probes/probe_before_after.py imports it beside
# the current one in one process: `scripts/baseline_tree.sh REV DIR` writes DIR/fusedkern_base (custom operators
# in the fusedkern_base namespace). DIR is best ignored by git (.git/info/exclude) and named in a device call's carry.
set -euo pipefail
rev="${1:?usage: scripts/baseline_tree.sh REV DIR}"
dir="${2:?usage: scripts/baseline_tree.sh REV DIR}"
rm -rf "$dir/fusedkern_base" && mkdir -p "$dir"
git archive "$rev" fusedkern | tar x -C "$dir"
mv "$dir/fusedkern" "$dir/fusedkern_base"
grep -rlZ "fusedkern" "$dir/fusedkern_base" --include=*.py | xargs -0 sed -i -E \
    -e 's/\bfusedkern(\.|::| import)/fusedkern_base\1/g' -e 's/^import fusedkern$/import fusedkern_base/'
echo "$rev" > "$dir/fusedkern_base/REVISION"
