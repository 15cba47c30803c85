# %% [markdown]
# # 01 · The fused loss, derived and checked
#
# An LM head followed by cross-entropy is `loss = CE(x Wᵀ, y)` with x: [T, H] activations,
# W: [V, H] the head, y: [T] targets. At the seeds' workload (T = 4096…32768 tokens, H = 4096,
# V = 128256, bf16) the logits x Wᵀ are 1–8 GiB; everything fusedkern does follows from computing
# the loss and its gradients *without keeping them*. This notebook derives each step and checks it
# numerically on small float64 tensors against PyTorch's autograd, so that every claim the later
# notebooks rest on is verified, not asserted.
#
# Steps: (1) loss and logits gradient (softmax − one-hot); (2) the three GEMMs of the backward;
# (3) the online log-sum-exp that lets one pass over the vocabulary compute the loss; (4) why
# chunking over tokens bounds memory and still needs only three GEMMs; (5) the options (label
# smoothing, z-loss, softcap, class weights) in one gradient formula; (6) per-token
# log-probabilities; (7) the SimPO loss and its per-token upstream gradient.

# %% tags=["parameters"]
quick = False  # smaller tensors
data_dir = "../data"  # unused here; every notebook takes the same knobs
figures_dir = "../figures"  # unused here
gpu = "h200"  # unused here
seed = 0
tokens = 24  # T of the small check tensors
hidden = 16  # H
vocab = 50  # V
block_v = 8  # vocabulary block of the online log-sum-exp
chunk_tokens = 5  # C, tokens per chunk in the chunking check (deliberately not dividing T)
pairs = 3  # B, SimPO pairs
seq = 7  # S, SimPO sequence length
seed_shape = {"tokens": [4096, 8192, 16384, 32768], "hidden": 4096, "vocab": 128256}  # the seeds' workload

# %%
# Derived sizes (papermill injects the knobs above; everything computed from them lives here).
if quick:
    tokens, hidden, vocab, block_v, chunk_tokens, pairs, seq = 9, 6, 13, 4, 4, 2, 5
T, H, V, C = tokens, hidden, vocab, chunk_tokens

# %%
import math

import pandas as pd
import torch
import torch.nn.functional as F

from fusedkern.chunk_plan import grad_chunk_plan
from fusedkern.study import memory_model
from fusedkern.study.tables import error_bound

torch.manual_seed(seed)
pd.set_option("display.precision", 3)
DT = torch.float64
# Errors are shown as the power of ten above them, at least 1e-15 (a few float64 ulps): the digits
# of a rounding error vary between CPU builds, and the rendered notebook should not.
FP64_NOISE = 1e-15
checks = []  # every numerical check of the notebook, summarized at the end


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-12) -> None:
    """Record max |got − want| / max(1, max |want|) and fail the notebook when it exceeds `tol`."""
    got, want = torch.as_tensor(got, dtype=DT), torch.as_tensor(want, dtype=DT)
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
    checks.append({"check": name, "relative error": err, "tolerance": tol, "ok": err <= tol})
    print(f"{'ok  ' if err <= tol else 'FAIL'} {name}: {error_bound(err, FP64_NOISE)}")
    assert err <= tol, f"{name}: error {err:.3e} > {tol:.0e}"


x = torch.randn(T, H, dtype=DT)
W = torch.randn(V, H, dtype=DT) / math.sqrt(H)
y = torch.randint(0, V, (T,))
y[::4] = -100  # some ignored tokens (prompt or padding), as in real batches
keep = y != -100
N = int(keep.sum())
print(f"x: {tuple(x.shape)}, W: {tuple(W.shape)}, {N} of {T} tokens count")

# %% [markdown]
# ## 1 · Loss and the gradient of the logits
#
# With z = x Wᵀ, lse_t = log Σ_v exp z_tv and p_tv = exp(z_tv − lse_t):
#
# ℓ_t = lse_t − z_{t,y_t},   L = (1/N) Σ_{t kept} ℓ_t,
#
# ∂ℓ_t/∂z_tv = p_tv − [v = y_t]   (softmax minus one-hot),
#
# so G = ∂L/∂z = g ⊙ (P − Y) with per-token upstream weight g_t = 1/N for kept tokens and 0 for
# ignored ones. Nothing in G needs more than the row's lse and the logits themselves: that is what
# lets a kernel form G in the same pass as the loss.

# %%
z = x @ W.T
lse = torch.logsumexp(z, dim=-1)
safe_y = y.clamp(min=0)
loss_t = torch.where(keep, lse - z.gather(1, safe_y[:, None])[:, 0], 0.0)
L = loss_t.sum() / N
check("loss = mean(lse − z_target) vs F.cross_entropy", L, F.cross_entropy(z, y, ignore_index=-100))

z_ad = z.clone().requires_grad_(True)
F.cross_entropy(z_ad, y, ignore_index=-100).backward()
P = torch.softmax(z, dim=-1)
Y = F.one_hot(safe_y, V).to(DT)
g = keep.to(DT) / N
G = g[:, None] * (P - Y)
check("dL/dz = g ⊙ (softmax − one-hot) vs autograd", G, z_ad.grad)

# %% [markdown]
# ## 2 · Three GEMMs
#
# z = x Wᵀ is one GEMM; the backward through it is two more: dX = G W ([T, V]·[V, H]) and
# dW = Gᵀ X ([V, T]·[T, H]). Each costs 2·T·H·V FLOPs, so forward + backward is 6·T·H·V — and
# that is the floor if G is formed while the logits are at hand. An implementation that drops the
# logits after the forward (to save memory) must recompute them for the backward: four GEMMs.

# %%
x_ad, W_ad = x.clone().requires_grad_(True), W.clone().requires_grad_(True)
F.cross_entropy(x_ad @ W_ad.T, y, ignore_index=-100).backward()
check("dX = G W vs autograd", G @ W, x_ad.grad)
check("dW = Gᵀ X vs autograd", G.T @ x, W_ad.grad)

H0, V0 = seed_shape["hidden"], seed_shape["vocab"]
work = pd.DataFrame(
    {
        "tokens": t,
        "TFLOP per GEMM": 2 * t * H0 * V0 / 1e12,
        "TFLOP, 3 GEMMs (G formed in the forward)": 6 * t * H0 * V0 / 1e12,
        "TFLOP, 4 GEMMs (logits recomputed)": 8 * t * H0 * V0 / 1e12,
    }
    for t in seed_shape["tokens"]
)
work.set_index("tokens")

# %% [markdown]
# Reading W (V·H·2 bytes ≈ 1 GB in bf16) takes well under a millisecond on an H200; the GEMMs take
# tens of milliseconds. The op is compute-bound, so the relevant floor is the three GEMMs' time
# (measured in notebooks 04–06), not a bandwidth bound.
#
# ## 3 · Online log-sum-exp: one pass over the vocabulary
#
# A kernel that never holds a full logits row sees the vocabulary block by block. Keeping a
# running maximum m and a running sum s of exp(z − m) gives the exact lse in one pass:
#
# m' = max(m, max_b z_b),   s' = s·exp(m − m') + Σ_b exp(z_b − m'),   lse = m + log s.
#
# Two partial states (m₁, s₁), (m₂, s₂) over disjoint blocks merge the same way, so the blocks may
# also be processed in parallel and combined in any order.

# %%
def online_lse(row: torch.Tensor, block: int) -> torch.Tensor:
    m, s = torch.tensor(-math.inf, dtype=DT), torch.tensor(0.0, dtype=DT)
    for start in range(0, row.numel(), block):
        zb = row[start:start + block]
        m_new = torch.maximum(m, zb.max())
        s = s * torch.exp(m - m_new) + torch.exp(zb - m_new).sum()
        m = m_new
    return m + torch.log(s)


def merge(a, b):
    (m1, s1), (m2, s2) = a, b
    m = max(m1, m2)
    return m, s1 * math.exp(m1 - m) + s2 * math.exp(m2 - m)


streamed = torch.stack([online_lse(row, block_v) for row in z])
check(f"online lse over blocks of {block_v} vs torch.logsumexp", streamed, lse, tol=1e-14)

half = V // 2
row = z[0] * 100  # large logits: the naive log(sum(exp)) overflows in fp32, the online form does not
m1, m2 = row[:half].max().item(), row[half:].max().item()
left = (m1, torch.exp(row[:half] - m1).sum().item())
right = (m2, torch.exp(row[half:] - m2).sum().item())
m, s = merge(right, left)  # order does not matter
check("merged partial (m, s) of two halves, logits ×100", torch.tensor(m + math.log(s), dtype=DT),
      torch.logsumexp(row, 0),
      tol=1e-14)
naive_fp32 = torch.log(torch.exp(row.float()).sum()).item()
print(f"lse of this row: {m + math.log(s):.3f}; naive log(sum(exp)) in fp32: {naive_fp32} (exp overflows past 88.7)")

# %% [markdown]
# ## 4 · Chunking over tokens bounds memory, and keeps three GEMMs
#
# Rows are independent: token t's loss and gradient row need only its own logits row. So the
# tokens can be processed in chunks of C rows, each through the full sequence
# logits → (lse, loss, G) → dX rows → dW contribution, reusing one C×V buffer:
#
# dX[c] = G[c] W,   dW = Σ_c G[c]ᵀ X[c].
#
# The extra memory is C·V elements instead of T·V, whatever T is, and G is formed while the
# logits chunk is in memory: still three GEMMs. The price is dW's accumulation across chunks (in
# fp32 when W is bf16, so that many small additions do not lose precision: a V×H×4-byte buffer).
# Chunking over the *vocabulary* instead would split each row's softmax, needing the online lse of
# §3 and a second pass to form G.

# %%
dX = torch.zeros_like(x)
dW = torch.zeros_like(W)
loss_sum = torch.zeros((), dtype=DT)
for c0 in range(0, T, C):
    xc, yc = x[c0:c0 + C], y[c0:c0 + C]
    zc = xc @ W.T  # the only [C, V] buffer
    lse_c = torch.logsumexp(zc, -1)
    kc = yc != -100
    yc_safe = yc.clamp(min=0)
    loss_sum += torch.where(kc, lse_c - zc.gather(1, yc_safe[:, None])[:, 0], 0.0).sum()
    Gc = (kc.to(DT) / N)[:, None] * (torch.softmax(zc, -1) - F.one_hot(yc_safe, V).to(DT))  # in place in a kernel
    dX[c0:c0 + C] = Gc @ W
    dW += Gc.T @ xc
check(f"chunked loss (C = {C}) vs full", loss_sum / N, L)
check("chunked dX vs autograd", dX, x_ad.grad)
check("chunked dW (accumulated over chunks) vs autograd", dW, W_ad.grad)

# %%

lean_chunk = memory_model.default_chunk_size(V0, "bfloat16")


def plan_row(t):
    plan = grad_chunk_plan(t, V0, H0, 2, need_dw=True, fp32_accum=True)
    where = "inside dW's storage" if plan.buffer_in_dw_storage else "own allocation"
    return {
        "tokens": t,
        "logits T×V bf16 (MiB)": t * V0 * 2 / 2**20,
        f"lean: chunk C×V, C = {lean_chunk} (MiB)": min(lean_chunk, t) * V0 * 2 / 2**20,
        "default: chunk C": plan.chunk_tokens,
        "default: buffer": where,
        "default: fp32 dW accumulator (MiB)": V0 * H0 * 4 / 2**20 if plan.fp32_accumulator else 0.0,
    }


pd.DataFrame(plan_row(t) for t in seed_shape["tokens"]).set_index("tokens").round(1)

# %% [markdown]
# The lean chunk stays at 250 MiB from 4096 to 32768 tokens while the full logits grow to 7.8 GiB.
# The default mode may also hold one fp32 V×H accumulator (2004 MiB), and `fusedkern/chunk_plan.py`
# spends that allowance on speed: up to 9216 tokens run as a single chunk with no accumulator at all
# (one dW GEMM, fp32 inside cuBLAS), and beyond that the accumulator collects dW while the logits
# buffer — 4096 tokens — lives inside dW's own bf16 storage, which is otherwise idle until the
# accumulator is cast into it. Fewer, larger chunks mean fewer passes of the fp32 accumulator
# through memory and larger GEMMs (notebook 07 measures the trade-off; notebook 03 models every
# provider's peak).
#
# ## 5 · Every option in one gradient
#
# With softcap s = c·tanh(z/c), class weights w_v (W_sum = Σ w_v), label smoothing ε and z-loss
# coefficient ζ, the per-token loss of docs/design.md is
#
# ℓ_t = (1−ε)·w_{y}·(lse − s_y) + (ε/V)·Σ_v w_v·(lse − s_v) + ζ·lse²,
#
# and its gradient, still a row-local expression in p = softmax(s):
#
# ∂ℓ/∂s_v = [(1−ε)·w_y + ε·W_sum/V + 2ζ·lse]·p_v − (1−ε)·w_y·[v = y] − (ε/V)·w_v,
# ∂ℓ/∂z_v = ∂ℓ/∂s_v · (1 − (s_v/c)²).
#
# The "mean" reduction divides by D = Σ_{kept} w_{y_t} (torch's normalization).

# %%
eps, zeta, cap = 0.1, 1e-3, 3.0
w_cls = torch.rand(V, dtype=DT) + 0.5
z_ad = z.clone().requires_grad_(True)
s_ad = cap * torch.tanh(z_ad / cap)
torch_loss = F.cross_entropy(s_ad, y, weight=w_cls, label_smoothing=eps, ignore_index=-100, reduction="sum")
lse_s = torch.logsumexp(s_ad, -1)
D = w_cls[safe_y][keep].sum()
full_loss = (torch_loss + zeta * (lse_s[keep] ** 2).sum()) / D
full_loss.backward()

s = cap * torch.tanh(z / cap)
p = torch.softmax(s, -1)
lse_s = torch.logsumexp(s, -1)
wy = w_cls[safe_y]
coef = (1 - eps) * wy + eps * w_cls.sum() / V + 2 * zeta * lse_s
dl_ds = coef[:, None] * p - ((1 - eps) * wy)[:, None] * Y - (eps / V) * w_cls[None, :]
dl_dz = dl_ds * (1 - (s / cap) ** 2)
G_opts = (keep.to(DT) / D)[:, None] * dl_dz
check("gradient formula with softcap, class weights, ε, z-loss vs autograd", G_opts, z_ad.grad)

# %% [markdown]
# ## 6 · Per-token log-probabilities
#
# Preference losses (DPO, CPO, SimPO, ORPO, KTO, IPO) touch the logits only through the targets'
# log-probabilities logp_t = z_{t,y_t} − lse_t = −ℓ_t (ε = ζ = 0, no class weights). Given any
# upstream gradient u_t = ∂L/∂logp_t, the logits gradient is again row-local:
#
# ∂L/∂z_tv = u_t·([v = y_t] − p_tv).
#
# One primitive returning logp and accepting u serves the whole family.

# %%
u = torch.randn(T, dtype=DT) * keep
z_ad = z.clone().requires_grad_(True)
logp = torch.where(keep, torch.log_softmax(z_ad, -1).gather(1, safe_y[:, None])[:, 0], 0.0)
(logp * u).sum().backward()
check("logp = z_target − lse vs log_softmax", logp.detach(), torch.where(keep, -loss_t, 0.0))
check("d(Σ u·logp)/dz = u ⊙ (one-hot − softmax) vs autograd", u[:, None] * (Y - P), z_ad.grad)

# %% [markdown]
# ## 7 · SimPO and its per-token gradient
#
# Input [2B, S, H]: rows 0…B−1 chosen, B…2B−1 rejected. A_i = (1/n_i)·Σ_t logp_it is the
# length-normalized log-probability (n_i kept tokens; an all-ignored response gets A = 0 rather
# than NaN), z_i = β(A_w,i − A_l,i) − γ, and
#
# L = (1/B) Σ_i [−(1−ε)·logσ(z_i) − ε·logσ(−z_i)] + α·NLL,   NLL = −Σ_{chosen kept} logp / N_w.
#
# With d_i = ∂/∂z_i of the bracket = −(1−ε)·σ(−z_i) + ε·σ(z_i), the upstream gradient per token is
#
# u_t = d_i·β / (B·n_w,i) − α / N_w   (chosen token of pair i),
# u_t = −d_i·β / (B·n_l,i)           (rejected token),   0 where ignored,
#
# and §6 turns it into the logits gradient u_t·(one-hot − softmax). For ε = 0 the chosen token's
# u_t = −β·σ(−z_i)/(B·n_w,i) − α/N_w is negative: raising a chosen token's log-probability lowers
# the loss, so ∂L/∂z_t = u_t·(one-hot − softmax) = |u_t|·(softmax − one-hot), the cross-entropy
# direction.

# %%
beta, gamma, alpha, eps_s = 2.0, 1.0, 0.5, 0.1  # non-default values so every term matters
logps = -torch.rand(2 * pairs, seq, dtype=DT) * 3
mask = torch.rand(2 * pairs, seq) > 0.3
mask[:, 0] = False  # a prompt token in every row
mask[-1] = False  # one rejected response with no token at all: A = 0, finite loss
logps_ad = logps.clone().requires_grad_(True)

n = mask.sum(-1).clamp(min=1).to(DT)
A = (logps_ad * mask).sum(-1) / n
zs = beta * (A[:pairs] - A[pairs:]) - gamma
N_w = mask[:pairs].sum().clamp(min=1).to(DT)
nll = -(logps_ad * mask)[:pairs].sum() / N_w
L_simpo = (-(1 - eps_s) * F.logsigmoid(zs) - eps_s * F.logsigmoid(-zs)).mean() + alpha * nll
L_simpo.backward()

zs_ = zs.detach()
d = -(1 - eps_s) * torch.sigmoid(-zs_) + eps_s * torch.sigmoid(zs_)
u_chosen = (d * beta / (pairs * n[:pairs]))[:, None] - alpha / N_w
u_rejected = (-d * beta / (pairs * n[pairs:]))[:, None]
u_simpo = torch.cat([u_chosen.expand(pairs, seq), u_rejected.expand(pairs, seq)]) * mask
print(f"SimPO loss {L_simpo.item():.6f} (finite with an empty response: {math.isfinite(L_simpo.item())})")
check("SimPO per-token upstream gradient vs autograd", u_simpo, logps_ad.grad)

# %%
from fusedkern.simpo import simpo_loss_from_logps  # noqa: E402  (the O(B·S) function the fused loss calls)

pkg_loss, _ = simpo_loss_from_logps(logps, mask, beta=beta, gamma=gamma, alpha=alpha, label_smoothing=eps_s)
check("this derivation vs fusedkern.simpo.simpo_loss_from_logps", pkg_loss, L_simpo.detach())

# %% [markdown]
# ## Summary
#
# Every identity the kernels rely on, checked in float64 (each error as the power of ten above it:
# all of them are float64 rounding, at most a few ulps of ε = 2.2e-16):

# %%
summary = pd.DataFrame(checks)
assert summary["ok"].all()
summary["relative error"] = summary["relative error"].map(lambda e: error_bound(e, FP64_NOISE))
summary.set_index("check")
