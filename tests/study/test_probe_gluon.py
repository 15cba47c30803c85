"""The Gluon probe (probes/gluon_logits_stats.py: warp-specialized, ping-pong LM-head GEMM with the row-statistics
epilogue) lowers to sm_90a on the CPU with zero spills and fits H100's shared memory, at its first two configs
(cooperative and ping-pong), with and without the bf16 logits store; its config names carry GROUP_M; and its
capped-grid correctness check makes every CTA walk many tiles (both ping-pong consumers, wrapped ring phases)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "probes" / "gluon_logits_stats.py"
needs_gluon = pytest.mark.skipif(importlib.util.find_spec("triton.experimental.gluon") is None,
                                 reason="triton.experimental.gluon is not installed")
# a fresh process: the compiler, not the interpreter the CPU suite switches on (the probe sets it at import)
ENV = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}


@needs_gluon
def test_gluon_probe_compiles_for_sm90_without_spills():
    command = [sys.executable, str(PROBE), "--compile",
               "--configs", "128x256x64s4coop,128x128x64s6c2"]  # cooperative and ping-pong
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("sm_90a ok")]
    assert len(lines) == 4, done.stdout
    assert all(" stack=0 spill=0 " in line for line in lines), lines
    assert all(int(line.split(" smem=")[1].split()[0]) <= 232448 for line in lines), lines


SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import gluon_logits_stats as g
out = {"configs": {}, "check_shapes": g.CHECK_SHAPES}
for name in g.DEFAULT_CONFIGS.split(",") + ["128x256x64s4coopg8", "128x128x64s6c2g4"]:
    c = g.parse_config(name)
    out["configs"][name] = dict(c, stages=[g.launch_params(c, wl)["STAGES"] for wl in (False, True)])
try:
    g.parse_config("128x256x64s4coopgx")
    out["bad_rejected"] = False
except ValueError:
    out["bad_rejected"] = True
print(json.dumps(out))
"""


@needs_gluon
def test_gluon_probe_group_knob_and_capped_grid_check_covers_pingpong():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "probes")], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.splitlines()[-1])
    configs = info["configs"]
    assert configs["128x256x64s4coop"]["GROUP_M"] == 16 and configs["128x256x64s4coopg8"]["GROUP_M"] == 8
    assert configs["128x128x64s6c2g4"]["GROUP_M"] == 4 and configs["128x128x64s6c2g4"]["COOP"] == 0
    assert info["bad_rejected"]
    capped = [s for s in info["check_shapes"] if s[3] > 0]
    assert capped, "no correctness check with a capped grid"
    for T, H, V, ctas in capped:
        for name, c in configs.items():
            tiles = -(-T // c["BLOCK_M"]) * -(-V // c["BLOCK_N"])
            least = tiles // ctas  # tiles of the CTA with the fewest
            k_tiles = -(-H // c["BLOCK_K"])
            # ping-pong: both consumers take several tiles; every mode: each slot's phase wraps several times
            assert least // c["NUM_CONSUMERS"] >= 3, (name, least)
            assert least * k_tiles >= 4 * max(c["stages"]), (name, least, k_tiles, c["stages"])
    assert any(s[3] == 0 and s[1] >= 4096 for s in info["check_shapes"]), "the study-shape check is gone"
