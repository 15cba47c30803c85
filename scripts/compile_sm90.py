"""Compile the Triton kernels for the H200 (sm_90) on a machine without a GPU.

The CPU test suite runs the kernels through Triton's interpreter, which never lowers them: an op the
GPU backend rejects, or a config that spills past the register file, would pass CI and fail on the
first GPU call. This lowers through Triton's NVIDIA backend down to a cubin (ptxas ships with Triton):
- `ce_rows`' two kernels for the smallest and largest autotune block, every option flag off and on,
  and with the row count, temperature and entropy the compacted and GRPO paths use (and the logits' sum of TRL's
  mean_logits); `scale`'s kernel;
- the fused strategy's forward and backward (`fused_ce`, bf16, the first autotune config: the one the
  H200 picks) in each launch mode, flags off and on;
- the row-count GEMMs (`rowcount_gemm`, bf16, the config the H200 picks) on both load paths, dX's
  wide/narrow pair and dW's three epilogues;
- the distillation row kernel (`distill_rows`, bf16 student and teacher) for each divergence, options off and on,
  and loss only;
- the Gluon logits-partials kernel of the loss-only pass (`gluon_logits_stats`, sm_90a, int64 and int32 targets, and
  with the entropy's statistic):
  its lines start "sm_90a ok: gluon" (warp-specialized; checked by tests/test_gluon_loss_only.py).
Every kernel gets the specialization a launch at the study's shapes gives it (unit inner strides as
constants; pointers, strides and sizes multiples of 16).
Prints one line per kernel with its registers per thread, stack bytes (spills) and shared memory from
the cubin, and the PTX's fingerprint: `ptx=` hashes the PTX without line information (equal means the same machine
code), `ops=` the sorted instructions with registers and labels renamed (equal means the same
instructions, possibly reordered). Run it before and after a refactor of a kernel to show the GPU gets
the same code (`--only NAME` limits it to kernels whose line contains NAME). Exits non-zero on the
first failure. With --ptxas-info each line also gets ptxas's own register and spill report for sm_90a.

    TRITON_INTERPRET=0 python scripts/compile_sm90.py [--ptxas-info] [--only NAME]
    (tests/test_compile_sm90.py runs it)
"""
import glob
import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before fusedkern imports: real JIT functions, GPU configs
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # line information moves with the source, not the code

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedkern.kernels import ce_rows, distill_rows, fused_ce, rowcount_gemm, scale  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200

STATS_SIGNATURE = {
    "partial_max_ptr": "*fp32", "partial_sumexp_ptr": "*fp32", "partial_wsum_ptr": "*fp32", "partial_ent_ptr": "*fp32",
    "logits_ptr": "*bf16", "class_weight_ptr": "*fp32", "target_ptr": "*i64", "target_logit_ptr": "*fp32",
    "row_count_ptr": "*i32", "V": "i32", "stride_row": "i64", "span": "i32", "partial_stride": "i32", "col_base": "i32",
    "softcap": "fp32", "logit_scale": "fp32",
}
FINISH_SIGNATURE = {
    "logits_ptr": "*bf16", "loss_ptr": "*fp32", "row_max_ptr": "*fp32", "log_sumexp_ptr": "*fp32",
    "partial_max_ptr": "*fp32", "partial_sumexp_ptr": "*fp32", "partial_wsum_ptr": "*fp32", "partial_ent_ptr": "*fp32",
    "entropy_ptr": "*fp32", "grad_entropy_ptr": "*fp32", "logit_sum_ptr": "*fp32", "target_ptr": "*i64",
    "target_logit_ptr": "*fp32", "class_weight_ptr": "*fp32", "class_weight_sum_ptr": "*fp32", "grad_ptr": "*fp32",
    "row_count_ptr": "*i32",
    "V": "i32", "stride_row": "i64", "span": "i32", "col_base": "i32", "vocab_total": "i32", "ignore_index": "i32",
    "label_smoothing": "fp32", "z_loss": "fp32", "softcap": "fp32", "logit_scale": "fp32",
}
SCALE_SIGNATURE = {"src_ptr": "*bf16", "out_ptr": "*bf16", "scale_ptr": "*fp32", "N": "i64"}
SCALE_INTO_SIGNATURE = {"src_ptr": "*fp32", "out_ptr": "*bf16", "scale_ptr": "*fp32", "N": "i64"}


FUSED_FWD_SIGNATURE = {
    "part_ptr": "*fp32", "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*i64", "cw_ptr": "*fp32",
    "T": "i32", "V": "i32", "H": "i32", "N_SPLIT": "i32", "SPLIT_V": "i32", "T_BUCKET": "i32",
    "stride_xt": "i32", "stride_xh": "i32", "stride_wv": "i32", "stride_wh": "i32", "stride_b": "i32",
    "stride_pk": "i32", "stride_ps": "i32", "SOFTCAP": "fp32",
}
FUSED_BWD_SIGNATURE = {
    "dx_ptr": "*fp32", "dw_ptr": "*fp32", "db_ptr": "*fp32", "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
    "y_ptr": "*i64", "cw_ptr": "*fp32", "row_max_ptr": "*fp32", "log_sumexp_ptr": "*fp32", "coef_ptr": "*fp32",
    "T": "i32", "V": "i32", "H": "i32", "T_START": "i32", "T_END": "i32", "V_START": "i32", "V_END": "i32",
    "T_BUCKET": "i32", "MODE": "i32", "stride_xt": "i32", "stride_xh": "i32", "stride_wv": "i32", "stride_wh": "i32",
    "stride_b": "i32", "stride_dxt": "i32", "stride_dwv": "i32", "IGNORE_INDEX": "i64", "SOFTCAP": "fp32",
}


def fused_cases() -> list:
    """(name, kernel, signature, flags, config) of the fused strategy: forward with every option off and
    on; backward in its three launch modes (dX pass, dW pass, single pass storing dW) off and on."""
    fwd_config, bwd_config = fused_ce._fwd_configs(False)[0], fused_ce._bwd_configs(False)[0]
    cases = []
    for on in (False, True):
        options = dict(HAS_BIAS=on, HAS_SOFTCAP=on, HAS_WEIGHT=on, HAS_SMOOTHING=on, DOT_PRECISION="tf32")
        cases.append(("fused_fwd", fused_ce._fused_ce_fwd_kernel, FUSED_FWD_SIGNATURE, options, fwd_config))
        for dx, dw, store in ((True, False, False), (False, True, False), (True, True, True)):
            cases.append(("fused_bwd", fused_ce._fused_ce_bwd_kernel, FUSED_BWD_SIGNATURE,
                          dict(options, COMPUTE_DX=dx, COMPUTE_DW=dw, COMPUTE_DB=on, GRAD_W_STORE=store, GROUP_T=8),
                          bwd_config))
    return cases


def jit_function(kernel) -> triton.runtime.JITFunction:
    return kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn  # autotuned kernels wrap it


#: inner strides of the GEMM operands (row-count GEMMs, fused strategy): 1 in every launch, which Triton
#: specializes into a constant
UNIT_STRIDES = ("stride_xh", "stride_wh", "stride_zv", "stride_gv", "stride_dxh", "stride_dwh", "stride_b")


def gemm_signature(kernel, pointer_types: dict) -> dict:
    """Signature of a row-count GEMM: pointers bf16 unless named, sizes and strides i32 (unit strides are
    constants, added by `gemm_cases`)."""
    names = [p.name for p in jit_function(kernel).params if not p.is_constexpr and p.name not in UNIT_STRIDES]
    return {n: pointer_types.get(n, "*bf16") if n.endswith("_ptr") else "i32" for n in names}


def gemm_cases() -> list:
    """(name, kernel, signature, flags, config) of the row-count GEMMs at the H200's config (the first
    autotune candidate of each: 128 × 256 × 64, 8 warps, 3 stages; dW with quarter-slice epilogues)."""
    rg = rowcount_gemm
    count = {"count_ptr": "*i32"}
    cases = []
    for tma in (True, False):
        common = dict(USE_TMA=tma, DOT_PRECISION="tf32")
        cases.append(("gemm_logits", rg._logits_kernel, gemm_signature(rg._logits_kernel, count),
                      dict(common, HAS_BIAS=True), rg._configs("logits", False)[0]))
        for pick in (1, 2):  # the wide kernel of dX's pair and its narrow partner
            config = rg._configs("dx", False)[0]
            config = config if pick == 1 else rg._narrow_partner(config)
            cases.append(("gemm_dx", rg._dx_kernel, gemm_signature(rg._dx_kernel, count), dict(common, PICK=pick),
                          config))
        # dW: β = 0 into bf16; β = 1 into the fp32 accumulator (TMA: reduce-add) and into bf16 (load-add-store)
        for accumulate, out, mode in ((False, "*bf16", 0), (True, "*fp32", 2), (True, "*bf16", 1)):
            cases.append(("gemm_dw", rg._dw_kernel, gemm_signature(rg._dw_kernel, {**count, "dw_ptr": out}),
                          dict(common, ACCUMULATE=accumulate, EPI_MODE=mode), rg._configs("dw", False)[0]))
    return cases


DISTILL_SIGNATURE = {
    "zs_ptr": "*bf16", "zt_ptr": "*bf16", "target_ptr": "*i64", "loss_ptr": "*fp32", "entropy_ptr": "*fp32",
    "grad_ptr": "*fp32", "V": "i32", "stride_s": "i32", "stride_t": "i32", "inv_temperature": "fp32", "beta": "fp32",
    "log_beta": "fp32", "log_1m_beta": "fp32", "one_m_beta": "fp32", "weight_soft": "fp32", "weight_hard": "fp32",
    "ignore_index": "i32", "s_scale": "fp32", "s_softcap": "fp32", "t_scale": "fp32", "t_softcap": "fp32",
}


def distill_cases() -> list:
    """(name, kernel, signature, flags, config) of the distillation row kernel at its GPU block: forward KL,
    reverse KL and JSD with every option off (gradient shared by every row) and on (targets with the hard-label
    term, per-token gradient, entropy, both softcaps), and the loss-only launch of `reduction="none"`'s forward."""
    config = triton.Config({"BLOCK_V": distill_rows.BLOCK_V}, num_warps=8)
    off = dict(HAS_TARGET=False, HAS_HARD=False, WRITE_GRAD=True, PER_TOKEN_GRAD=False, HAS_ENTROPY=False,
               S_SOFTCAP=False, T_SOFTCAP=False)
    on = dict(HAS_TARGET=True, HAS_HARD=True, WRITE_GRAD=True, PER_TOKEN_GRAD=True, HAS_ENTROPY=True,
              S_SOFTCAP=True, T_SOFTCAP=True)
    modes = (distill_rows.FORWARD_KL, distill_rows.REVERSE_KL, distill_rows.JSD)
    cases = [("distill", distill_rows._distill_rows_kernel, DISTILL_SIGNATURE, dict(flags, MODE=mode), config)
             for mode in modes for flags in (off, on)]
    cases.append(("distill", distill_rows._distill_rows_kernel, DISTILL_SIGNATURE,
                  dict(on, WRITE_GRAD=False, PER_TOKEN_GRAD=False, MODE=distill_rows.JSD), config))
    return cases


def gluon_cases() -> list:
    """(name, target dtype, entropy) of the Gluon loss-only kernel; empty when this Triton has no Gluon."""
    import importlib.util

    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return []
    return [("gluon_partials", "i64", False), ("gluon_partials", "i32", False), ("gluon_partials", "i64", True)]


def compile_gluon(target_type: str, with_entropy: bool):
    """The Gluon kernel at its launch parameters, lowered to sm_90a (wgmma, setmaxnreg): a launch at the study's
    shapes gives 16-divisible partial pointers, H and partial_stride (the targets are a launch's slices)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from fusedkern.kernels import gluon_logits_stats as g

    a, b = g.shared_layouts()
    signature = {
        "x_desc": f"tensordesc<bf16[{g.BLOCK_M}, {g.BLOCK_K}],{a!r}>",
        "w_desc": f"tensordesc<bf16[{g.BLOCK_N}, {g.BLOCK_K}],{b!r}>",
        "part_max_ptr": "*fp32", "part_rest_ptr": "*fp32", "part_ent_ptr": "*fp32", "target_ptr": f"*{target_type}",
        "target_logit_ptr": "*fp32", "T": "i32", "V": "i32", "H": "i32", "partial_stride": "i32",
        "logit_scale": "fp32",
    }
    constexprs = dict(GROUP_M=g.GROUP_M, STAGES=g.STAGES, HAS_ENTROPY=with_entropy, CONSUMER_REGS=g.CONSUMER_REGS,
                      PRODUCER_REGS=g.PRODUCER_REGS)
    signature.update({k: "constexpr" for k in constexprs})
    names = g._logits_partials_kernel.arg_names
    attrs = {(names.index(n), ): [["tt.divisibility", 16]]
             for n in ("part_max_ptr", "part_rest_ptr", "part_ent_ptr", "H", "partial_stride")}
    source = GluonASTSource(fn=g._logits_partials_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": g.NUM_WARPS, "maxnreg": g.MAXNREG})


def compile_one(kernel, signature: dict, constexprs: dict, config: triton.Config):
    jit_fn = jit_function(kernel)
    constexprs = {**constexprs, **config.kwargs}
    if "USE_LIBDEVICE" in jit_fn.arg_names:
        constexprs["USE_LIBDEVICE"] = True
    constexprs.update({n: 1 for n in UNIT_STRIDES if n in jit_fn.arg_names})
    full_signature = {**signature, **{name: "constexpr" for name in constexprs}}
    # what a launch at the study's shapes tells the compiler: pointers (torch allocations), strides and
    # the sizes C, V, H, T are multiples of 16 (Triton's specialization of integer arguments)
    # (less what the kernel leaves unspecialized: do_not_specialize, do_not_specialize_on_alignment)
    loose = {p.name for p in jit_fn.params if p.do_not_specialize or p.do_not_specialize_on_alignment}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jit_fn.arg_names)
             if full_signature.get(n) not in (None, "constexpr", "fp32") and n not in loose
             and (n.endswith("_ptr") or n.startswith("stride_") or n in ("C", "V", "H", "T"))}
    source = ASTSource(fn=jit_fn, signature=full_signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def fingerprints(compiled, name: str) -> str:
    """ptx=: hash of the PTX (kernel name and comments out); ops=: hash of its sorted instructions with
    registers and labels renamed, equal when only their order changed."""
    ptx = re.sub(r"^\s*//.*$", "", compiled.asm["ptx"].replace(name, "KERNEL"), flags=re.M)
    ops = sorted(line.strip() for line in re.sub(r"%[a-z]+[0-9]+|\$L__\w+", "R", ptx).splitlines()
                 if line.strip() and ".reg " not in line)
    return (f"ptx={hashlib.sha1(ptx.encode()).hexdigest()[:12]} "
            f"ops={hashlib.sha1(chr(10).join(ops).encode()).hexdigest()[:12]}")


def resources(compiled) -> str:
    """Registers per thread and stack bytes (spills) of the cubin, as cuobjdump reports them."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", report), re.search(r"STACK:(\d+)", report)
    # smem: shared memory per program
    return (f"regs={regs.group(1) if regs else '?'} stack={stack.group(1) if stack else '?'} "
            f"smem={compiled.metadata.shared}")


def ptxas_info(compiled) -> str:
    """ptxas -v on the kernel's PTX: registers per thread and spill bytes (Triton's bundled ptxas)."""
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))[0]
    with tempfile.TemporaryDirectory() as scratch:
        ptx, cubin = os.path.join(scratch, "k.ptx"), os.path.join(scratch, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", cubin], capture_output=True,
                                text=True).stderr
    lines = [line.split("info    :")[-1].strip() for line in report.splitlines()
             if "registers" in line or "spill" in line]
    return " | ".join(lines)


def main() -> int:
    configs = ce_rows._CONFIGS
    ends = [min(configs, key=lambda c: c.kwargs["BLOCK_V"]),
            max(configs, key=lambda c: (c.kwargs["BLOCK_V"], c.num_warps))]
    cases = []
    off = dict(HAS_ROW_COUNT=False, HAS_ENTROPY=False, HAS_SCALE=False)
    for on in (False, True):
        cases.append(("stats", ce_rows._row_stats_kernel, STATS_SIGNATURE,
                      dict(off, SPLIT=8, HAS_WEIGHT=on, HAS_SMOOTHING=on, HAS_SOFTCAP=on, FIND_TARGET=on)))
    # the compacted chunks' row count, a temperature and the entropy (GRPO's log-probs)
    cases.append(("stats", ce_rows._row_stats_kernel, STATS_SIGNATURE,
                  dict(SPLIT=8, HAS_WEIGHT=False, HAS_SMOOTHING=False, HAS_SOFTCAP=True, FIND_TARGET=True,
                       HAS_ROW_COUNT=True, HAS_ENTROPY=True, HAS_SCALE=True)))
    # forward with gradient · backward with per-token gradient · merge of a loss-only forward's tiles
    for split, compute_stats, write_grad, per_token in ((8, True, True, False), (1, False, True, True),
                                                        (16, True, False, False)):
        for on in (False, True):
            cases.append(("finish", ce_rows._row_finish_kernel, FINISH_SIGNATURE,
                          dict(off, SPLIT=split, HAS_WEIGHT=on, HAS_SOFTCAP=on, COMPUTE_STATS=compute_stats,
                               WRITE_GRAD=write_grad, PER_TOKEN_GRAD=per_token, SUM_LOGITS=False)))
        # the same three launches with a row count, a temperature and the entropy (and its gradient), and the
        # logits' sum where statistics are computed (TRL's mean_logits)
        cases.append(("finish", ce_rows._row_finish_kernel, FINISH_SIGNATURE,
                      dict(SPLIT=split, HAS_WEIGHT=False, HAS_SOFTCAP=True, COMPUTE_STATS=compute_stats,
                           WRITE_GRAD=write_grad, PER_TOKEN_GRAD=per_token, HAS_ROW_COUNT=True, HAS_ENTROPY=True,
                           HAS_SCALE=True, SUM_LOGITS=compute_stats)))
    runs = [(name, kernel, signature, flags, config) for name, kernel, signature, flags in cases for config in ends]
    runs.append(("scale", scale._scale_kernel, SCALE_SIGNATURE, {"SKIP_ONE": True},
                 triton.Config({"BLOCK": scale.BLOCK}, num_warps=8)))
    runs.append(("scale_into", scale._scale_kernel, SCALE_INTO_SIGNATURE, {"SKIP_ONE": False},
                 triton.Config({"BLOCK": scale.BLOCK}, num_warps=8)))
    args = sys.argv[1:]
    with_info = "--ptxas-info" in args
    only = args[args.index("--only") + 1] if "--only" in args else ""
    every = runs + fused_cases() + gemm_cases() + distill_cases()
    for name, kernel, signature, flags, config in every:
        blocks = " ".join(f"{k}={v}" for k, v in config.kwargs.items() if k.startswith("BLOCK"))
        line = f"{name} {blocks} warps={config.num_warps} stages={config.num_stages} {flags}"
        if only not in line:
            continue
        try:
            compiled = compile_one(kernel, signature, flags, config)
        except Exception as error:  # noqa: BLE001  (report which variant, then fail)
            print(f"FAILED {line}: {type(error).__name__}: {error}", flush=True)
            return 1
        info = f" :: {ptxas_info(compiled)}" if with_info else ""
        fingerprint = fingerprints(compiled, jit_function(kernel).__name__)
        print(f"sm_90 ok: {line} {resources(compiled)} {fingerprint}{info}", flush=True)
    for name, target_type, with_entropy in gluon_cases():
        line = f"{name} target={target_type}" + (" entropy" if with_entropy else "")
        if only not in line:
            continue
        try:
            compiled = compile_gluon(target_type, with_entropy)
        except Exception as error:  # noqa: BLE001  (report which variant, then fail)
            print(f"FAILED {line}: {type(error).__name__}: {error}", flush=True)
            return 1
        # ptxas's spill report always: a warp-specialized kernel's registers are set by setmaxnreg, not at launch
        fingerprint = fingerprints(compiled, "_logits_partials_kernel")
        print(f"sm_90a ok: {line} {resources(compiled)} {fingerprint} :: {ptxas_info(compiled)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
