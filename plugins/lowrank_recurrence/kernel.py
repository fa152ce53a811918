"""The DLite sequential head (DESIGN 1.2) as ONE OpenAI Triton kernel: all K steps of a block.

One program per sequence. Parameters: the node's inputs (in ``export.recurrence.INPUT_NAMES``
order), the scalars, then the outputs (tokens, logits, workspace): the order TensorRT's AOT
plugins launch a kernel with. Per step k: e = E[prev]; [g; c] = W_s [s; e] + b_s;
s = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c); z = W_m [s; h_k] + b_m; logits = W_o z;
d_k = argmax(logits) (greedy rows) or an inverse-CDF sample of softmax(logits / T) with the
uniform u[k] (sampling rows; the same rule as ``runtime.sampling.sample_categorical``);
prev = d_k. The vocabulary projection is tiled (BLOCK_V) and reduced on the fly: greedy keeps
a running (max, argmax); sampling keeps a running max and sum, then finds the sample in a
second pass over the logits it wrote (rejection sampling needs them: the draft's q).
Matrix-vector products stream their weights in BLOCK_C-column chunks; the state and latent
live in a small per-sequence scratch buffer in global memory, so any rank fits.

Run on a GPU, or on the CPU with TRITON_INTERPRET=1 (set before this module is imported).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _matvec(w_ptr, w_row_stride, col0, x_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """sum_j W[r, col0 + j] * x[j] for r < n_rows, j < n_cols; returns [BLOCK_R] fp32."""
    rows = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c in range(0, n_cols, BLOCK_C):
        cols = c + tl.arange(0, BLOCK_C)
        x = tl.load(x_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * w_row_stride + col0 + cols[None, :],
                    mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


@triton.jit
def _step(emb_ptr, ws_ptr, bs_ptr, wm_ptr, bm_ptr, prev, hidden_ptr, has_hidden: tl.constexpr, state_ptr, latent_ptr,
          R, H,
          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One gated update of the state (in scratch) and the latent z (in scratch)."""
    rows = tl.arange(0, BLOCK_R)
    in_r = rows < R
    e_ptr = emb_ptr + prev * R
    gate = (_matvec(ws_ptr, 2 * R, 0, state_ptr, R, R, BLOCK_R, BLOCK_C)
            + _matvec(ws_ptr, 2 * R, R, e_ptr, R, R, BLOCK_R, BLOCK_C)
            + tl.load(bs_ptr + rows, mask=in_r, other=0.0).to(tl.float32))
    cand = (_matvec(ws_ptr + R * 2 * R, 2 * R, 0, state_ptr, R, R, BLOCK_R, BLOCK_C)
            + _matvec(ws_ptr + R * 2 * R, 2 * R, R, e_ptr, R, R, BLOCK_R, BLOCK_C)
            + tl.load(bs_ptr + R + rows, mask=in_r, other=0.0).to(tl.float32))
    g = tl.sigmoid(gate)
    state = tl.load(state_ptr + rows, mask=in_r, other=0.0)
    state = g * state + (1.0 - g) * (2.0 * tl.sigmoid(2.0 * cand) - 1.0)  # tanh(c) = 2 sigmoid(2c) - 1
    tl.debug_barrier()
    tl.store(state_ptr + rows, state, mask=in_r)
    tl.debug_barrier()
    latent = _matvec(wm_ptr, R + H, 0, state_ptr, R, R, BLOCK_R, BLOCK_C) + tl.load(bm_ptr + rows, mask=in_r,
                                                                                  other=0.0).to(tl.float32)
    if has_hidden:
        latent += _matvec(wm_ptr, R + H, R, hidden_ptr, R, H, BLOCK_R, BLOCK_C)
    tl.store(latent_ptr + rows, latent, mask=in_r)
    tl.debug_barrier()


@triton.jit
def lowrank_recurrence_kernel(
    hidden_ptr,  # [B, K, H] the backbone's output
    anchor_ptr,  # [B] int64
    seed_ptr,  # [B] int64 token before the anchor (used when HAS_SEED)
    temperature_ptr,  # [B] fp32 (<= GREEDY_EPS: greedy)
    uniforms_ptr,  # [B, K] fp32 in [0, 1) (read for sampling rows)
    emb_ptr, ws_ptr, bs_ptr, wm_ptr, bm_ptr, wo_ptr,  # the head weights, as in HeadWeights
    K, H, R, V,  # int32 scalars (TensorRT's AOT plugins pass them between inputs and outputs)
    tokens_ptr,  # [B, K] int64 out
    logits_ptr,  # [B, K, V] fp32 out (written when WRITE_LOGITS)
    scratch_ptr,  # [B, 2, R] fp32 workspace: state, latent
    GREEDY_EPS: tl.constexpr, HAS_SEED: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_R)
    state_ptr = scratch_ptr + b * 2 * R
    latent_ptr = state_ptr + R
    tl.store(state_ptr + rows, tl.zeros([BLOCK_R], dtype=tl.float32), mask=rows < R)
    tl.debug_barrier()
    if HAS_SEED:  # G > 1: one step on the token before the anchor, hidden = 0, latent unused
        _step(emb_ptr, ws_ptr, bs_ptr, wm_ptr, bm_ptr, tl.load(seed_ptr + b), hidden_ptr, False, state_ptr,
              latent_ptr, R, H, BLOCK_R, BLOCK_C)
    temperature = tl.load(temperature_ptr + b)
    greedy = temperature <= GREEDY_EPS
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    prev = tl.load(anchor_ptr + b)
    for k in range(0, K):
        _step(emb_ptr, ws_ptr, bs_ptr, wm_ptr, bm_ptr, prev, hidden_ptr + (b * K + k) * H, True, state_ptr,
              latent_ptr, R, H, BLOCK_R, BLOCK_C)
        row_logits = logits_ptr + (b * K + k) * V
        best = -float("inf")
        best_id = 0
        run_max = -float("inf")
        run_sum = 0.0
        for v0 in range(0, V, BLOCK_V):  # pass 1: logits tile by tile
            vocab = v0 + tl.arange(0, BLOCK_V)
            in_v = vocab < V
            logit = _matvec(wo_ptr + v0 * R, R, 0, latent_ptr, V - v0, R, BLOCK_V, BLOCK_C)
            logit = tl.where(in_v, logit, -float("inf"))
            if WRITE_LOGITS:
                tl.store(row_logits + vocab, logit, mask=in_v)
            tile_best = tl.max(logit, axis=0)
            tile_id = tl.min(tl.where(logit == tile_best, vocab, V), axis=0)  # the first maximum, as argmax
            better = tile_best > best
            best_id = tl.where(better, tile_id, best_id)
            best = tl.where(better, tile_best, best)
            scaled = logit * inv_t
            new_max = tl.maximum(run_max, tl.max(scaled, axis=0))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.where(in_v, tl.exp(scaled - new_max), 0.0),
                                                                   axis=0)
            run_max = new_max
        chosen = best_id.to(tl.int64)
        if WRITE_LOGITS:
            if not greedy:  # pass 2: inverse CDF over the written logits: #{i : cdf_i <= u * total}
                tl.debug_barrier()
                target = tl.load(uniforms_ptr + b * K + k) * run_sum
                cum = 0.0
                count = 0
                for v0 in range(0, V, BLOCK_V):
                    vocab = v0 + tl.arange(0, BLOCK_V)
                    in_v = vocab < V
                    p = tl.where(in_v, tl.exp(tl.load(row_logits + vocab, mask=in_v, other=0.0) * inv_t - run_max),
                                 0.0)
                    cdf = cum + tl.cumsum(p, axis=0)
                    count += tl.sum(tl.where(in_v & (cdf <= target), 1, 0), axis=0)
                    cum += tl.sum(p, axis=0)
                chosen = tl.minimum(count, V - 1).to(tl.int64)
        tl.store(tokens_ptr + b * K + k, chosen)
        prev = chosen
