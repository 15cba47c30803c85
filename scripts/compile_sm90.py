"""Compile the Triton kernels for the H200 (sm_90) on a machine without a GPU.

The CPU test suite runs the kernels through Triton's interpreter, which never lowers them: an op the
GPU backend rejects, or a config that spills past the register file, would pass CI and fail on the
first GPU call. This lowers `ce_rows`' two kernels through Triton's NVIDIA backend down to a cubin
(ptxas ships with Triton) for the smallest and largest autotune block, and the fused strategy's
forward and backward (`fused_ce`, bf16, the first autotune config: the one the H200 picks) in each
launch mode, with every option flag off and on. Prints one line per kernel; exits non-zero on the
first failure. With --ptxas-info each line also gets ptxas's register and spill report for sm_90a
(how a kernel change's register pressure was checked without a GPU).

    TRITON_INTERPRET=0 python scripts/compile_sm90.py [--ptxas-info]   (tests/test_compile_sm90.py runs it)
"""
import glob
import os
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before fusedkern imports: real JIT functions, GPU configs

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedkern.kernels import ce_rows, fused_ce  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200

STATS_SIGNATURE = {
    "partial_max_ptr": "*fp32", "partial_sumexp_ptr": "*fp32", "partial_wsum_ptr": "*fp32", "logits_ptr": "*bf16",
    "class_weight_ptr": "*fp32", "target_ptr": "*i64", "target_logit_ptr": "*fp32", "V": "i32", "stride_row": "i64",
    "span": "i32", "partial_stride": "i32", "col_base": "i32", "softcap": "fp32",
}
FINISH_SIGNATURE = {
    "logits_ptr": "*bf16", "loss_ptr": "*fp32", "row_max_ptr": "*fp32", "log_sumexp_ptr": "*fp32",
    "partial_max_ptr": "*fp32", "partial_sumexp_ptr": "*fp32", "partial_wsum_ptr": "*fp32", "target_ptr": "*i64",
    "target_logit_ptr": "*fp32", "class_weight_ptr": "*fp32", "class_weight_sum_ptr": "*fp32", "grad_ptr": "*fp32",
    "V": "i32", "stride_row": "i64", "span": "i32", "col_base": "i32", "vocab_total": "i32", "ignore_index": "i32",
    "label_smoothing": "fp32", "z_loss": "fp32",
    "softcap": "fp32",
}


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


def compile_one(kernel, signature: dict, constexprs: dict, config: triton.Config):
    constexprs = {**constexprs, **config.kwargs, "USE_LIBDEVICE": True}
    full_signature = {**signature, **{name: "constexpr" for name in constexprs}}
    jit_fn = kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn  # autotuned kernels wrap it
    source = ASTSource(fn=jit_fn, signature=full_signature, constexprs=constexprs)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


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
    for on in (False, True):
        cases.append(("stats", ce_rows._row_stats_kernel, STATS_SIGNATURE,
                      dict(SPLIT=8, HAS_WEIGHT=on, HAS_SMOOTHING=on, HAS_SOFTCAP=on, FIND_TARGET=on)))
    # forward with gradient · backward with per-token gradient · merge of a loss-only forward's tiles
    for split, compute_stats, write_grad, per_token in ((8, True, True, False), (1, False, True, True),
                                                        (16, True, False, False)):
        for on in (False, True):
            cases.append(("finish", ce_rows._row_finish_kernel, FINISH_SIGNATURE,
                          dict(SPLIT=split, HAS_WEIGHT=on, HAS_SOFTCAP=on, COMPUTE_STATS=compute_stats,
                               WRITE_GRAD=write_grad, PER_TOKEN_GRAD=per_token)))
    runs = [(name, kernel, signature, flags, config) for name, kernel, signature, flags in cases for config in ends]
    with_info = "--ptxas-info" in sys.argv[1:]
    for name, kernel, signature, flags, config in runs + fused_cases():
        try:
            compiled = compile_one(kernel, signature, flags, config)
        except Exception as error:  # noqa: BLE001  (report which variant, then fail)
            print(f"FAILED {name} {flags} {config}: {type(error).__name__}: {error}", flush=True)
            return 1
        info = f" :: {ptxas_info(compiled)}" if with_info else ""
        print(f"sm_90 ok: {name} BLOCK_V={config.kwargs['BLOCK_V']} warps={config.num_warps} {flags}{info}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
