/* Inference kernels for few rows (decoding, speculative verification) on the CPU, fp32.
 *
 * Batch-1 decoding reads every active weight once per token, so its speed limit is memory
 * bandwidth. A BLAS GEMM called with 1-8 rows reaches well under that limit (about half for one
 * row, a fifth for four on a 2-core AVX2/AVX-512 machine; benchmarks/README.md), and an
 * elementwise chain of tiny torch ops costs more in dispatch than in arithmetic. These kernels
 * stream each weight row once for all rows of the call and fuse the Mamba-2 step into one pass.
 * Each has a pure-torch reference it is tested against (tests/test_native_kernels.py); the
 * Python side (`hybridlm.ops.native`) compiles this file on first use and falls back to the
 * references when no C compiler is present.
 *
 * The training kernels at the end fuse the Mamba-2 mixer's elementwise chains over whole
 * sequences (causal conv + SiLU, the group-gated RMSNorm), forward and backward; their autograd
 * wrappers are tested against autograd of the references.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define VL 16 /* floats per vector: AVX-512 width; GCC splits it on narrower machines */
typedef float vf __attribute__((vector_size(VL * sizeof(float)), aligned(4)));
#define MAXM 8
/* Below about a megabyte of weights one thread finishes before a sleeping OpenMP worker wakes
 * up (tens of microseconds on a virtual machine), so small calls run on the calling thread. */
#define PARALLEL_MIN_FLOATS (1L << 18)

static inline float hsum(vf v) {
  float s = 0.f;
  for (int j = 0; j < VL; j++) s += v[j];
  return s;
}

/* dot products of one weight row with m (<= MAXM) input rows, the row read once */
static inline void dots(const float *w, const float *x, long ldx, long m, long n, float *out) {
  vf acc[MAXM];
  for (long r = 0; r < m; r++) acc[r] = (vf){0};
  long i = 0;
  for (; i + VL <= n; i += VL) {
    vf wv;
    memcpy(&wv, w + i, sizeof(vf));
    for (long r = 0; r < m; r++) {
      vf xv;
      memcpy(&xv, x + r * ldx + i, sizeof(vf));
      acc[r] += wv * xv;
    }
  }
  for (long r = 0; r < m; r++) {
    float s = hsum(acc[r]);
    for (long j = i; j < n; j++) s += w[j] * x[r * ldx + j];
    out[r] = s;
  }
}

/* Input rows per register tile. A 4 x MR tile holds 4 * MR accumulators, 4 weight vectors and
 * one input vector: 21 of AVX-512's 32 zmm registers for MR = 4. Without AVX-512 a vf is two
 * ymm halves of 16 registers, so MR = 2 (26 halves: a few spill, far fewer than an accumulator
 * array of runtime length, which the compiler keeps in memory). */
#ifdef __AVX512F__
#define MR 4
#else
#define MR 2
#endif

/* out[j][r0 + r] = W[j] . x[r] for 4 weight rows and mr (<= MR, a constant after inlining)
 * input rows: every weight vector loaded once feeds mr FMAs, every input vector 4 */
static inline __attribute__((always_inline)) void tile(const float *W, long ldw, const float *x,
                                                       long ldx, long n, const int mr,
                                                       float out[4][MAXM], long r0) {
  vf acc[4][MR];
  for (int j = 0; j < 4; j++)
    for (int r = 0; r < mr; r++) acc[j][r] = (vf){0};
  long i = 0;
  for (; i + VL <= n; i += VL) {
    vf w[4];
    for (int j = 0; j < 4; j++) memcpy(&w[j], W + j * ldw + i, sizeof(vf));
    for (int r = 0; r < mr; r++) {
      vf xv;
      memcpy(&xv, x + r * ldx + i, sizeof(vf));
      for (int j = 0; j < 4; j++) acc[j][r] += w[j] * xv;
    }
  }
  for (int j = 0; j < 4; j++)
    for (int r = 0; r < mr; r++) {
      float s = hsum(acc[j][r]);
      for (long t = i; t < n; t++) s += W[j * ldw + t] * x[r * ldx + t];
      out[j][r0 + r] = s;
    }
}

/* out[j][r] = W[j] . x[r] for the nr (<= 4) weight rows at W (row stride ldw) and the m
 * (<= MAXM) input rows at x (row stride ldx). Full blocks of 4 weight rows go through register
 * tiles of up to MR input rows (the 4 rows stay in L1 between tiles, so memory reads them once);
 * a last block of fewer rows takes one row at a time. Every weight-row loop below walks the
 * rows in blocks of 4 through this. */
static inline void block_dots(const float *W, long ldw, long nr, const float *x, long ldx, long m,
                              long n, float out[4][MAXM]) {
  if (nr < 4) {
    for (long j = 0; j < nr; j++) dots(W + j * ldw, x, ldx, m, n, out[j]);
    return;
  }
  for (long r0 = 0; r0 < m; r0 += MR) {
    const float *xr = x + r0 * ldx;
    switch (m - r0 < MR ? m - r0 : MR) {
    case 1: tile(W, ldw, xr, ldx, n, 1, out, r0); break;
#if MR >= 2
    case 2: tile(W, ldw, xr, ldx, n, 2, out, r0); break;
#endif
#if MR >= 4
    case 3: tile(W, ldw, xr, ldx, n, 3, out, r0); break;
    case 4: tile(W, ldw, xr, ldx, n, 4, out, r0); break;
#endif
    }
  }
}

/* y[M, O] = x[M, I] @ W[O, I]^T (+ bias[O]); blocks of 4 rows of W split over threads */
void hl_linear(const float *x, const float *W, const float *bias, float *y, long M, long O,
               long I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (O * I >= PARALLEL_MIN_FLOATS)
  for (long o0 = 0; o0 < O; o0 += 4) {
    long nr = O - o0 < 4 ? O - o0 : 4;
    float out[4][MAXM];
    for (long m0 = 0; m0 < M; m0 += MAXM) {
      long m = M - m0 < MAXM ? M - m0 : MAXM;
      block_dots(W + o0 * I, I, nr, x + m0 * I, I, m, I, out);
      for (long j = 0; j < nr; j++)
        for (long r = 0; r < m; r++)
          y[(m0 + r) * O + o0 + j] = out[j][r] + (bias ? bias[o0 + j] : 0.f);
    }
  }
}

/* y[M, D] = x / sqrt(mean(x^2) + eps) * w (RMSNorm; statistics in double) */
void hl_rms_norm(const float *x, const float *w, float *y, long M, long D, float eps) {
  for (long r = 0; r < M; r++) {
    const float *xr = x + r * D;
    double ss = 0.0;
    for (long i = 0; i < D; i++) ss += (double)xr[i] * xr[i];
    float inv = 1.f / sqrtf((float)(ss / D) + eps);
    for (long i = 0; i < D; i++) y[r * D + i] = xr[i] * inv * w[i];
  }
}

/* Routed experts for T tokens with K choices each (relu^2 MLPs, W -> F -> W):
 * y[t] = sum_k gate[t, k] * down[e] relu2(up[e] z[t]), e = idx[t, k].
 * Assignments are grouped by expert so each chosen expert's weights are read once per call;
 * one parallel region covers all groups (a barrier between the up and down products).
 * h: scratch of T*K*F floats, zs: scratch of T*K*W floats. Returns the number of assignments
 * with an expert in [0, E); the others are skipped (the caller reports them). */
long hl_experts(const float *z, const int64_t *idx, const float *gate, const float *up,
                const float *down, float *y, float *h, float *zs, long T, long K, long E, long W,
                long F, int nthreads) {
  long A = T * K;
  long order[A > 0 ? A : 1], start[A + 1], n = 0, groups = 0;
  for (long e = 0; e < E && n < A; e++) { /* assignments sorted by expert, stable */
    long before = n;
    for (long a = 0; a < A; a++)
      if (idx[a] == e) order[n++] = a;
    if (n > before) start[groups++] = before;
  }
  start[groups] = n;
  for (long j = 0; j < n; j++) memcpy(zs + j * W, z + (order[j] / K) * W, W * sizeof(float));
  memset(y, 0, sizeof(float) * T * W);
  long work = groups * 2 * F * W;
#pragma omp parallel num_threads(nthreads) if (work >= PARALLEL_MIN_FLOATS)
  for (long g = 0; g < groups; g++) {
    long e = idx[order[start[g]]];
    const float *U = up + e * F * W, *Dn = down + e * W * F;
    for (long c0 = start[g]; c0 < start[g + 1]; c0 += MAXM) {
      long m = start[g + 1] - c0 < MAXM ? start[g + 1] - c0 : MAXM;
#pragma omp for schedule(static)
      for (long f0 = 0; f0 < F; f0 += 4) {
        long nr = F - f0 < 4 ? F - f0 : 4;
        float out[4][MAXM];
        block_dots(U + f0 * W, W, nr, zs + c0 * W, W, m, W, out);
        for (long j = 0; j < nr; j++)
          for (long r = 0; r < m; r++)
            h[(c0 + r) * F + f0 + j] = out[j][r] > 0.f ? out[j][r] * out[j][r] : 0.f;
      }
#pragma omp for schedule(static)
      for (long o0 = 0; o0 < W; o0 += 4) {
        long nr = W - o0 < 4 ? W - o0 : 4;
        float out[4][MAXM];
        block_dots(Dn + o0 * F, F, nr, h + c0 * F, F, m, F, out);
        for (long j = 0; j < nr; j++)
          for (long r = 0; r < m; r++) {
            long a = order[c0 + r];
            y[(a / K) * W + o0 + j] += gate[a] * out[j][r];
          }
      }
    }
  }
  return n;
}

static inline float silu(float v) { return v / (1.f + expf(-v)); }

/* One Mamba-2 decode step after in_proj, for Bsz rows (Mamba2Mixer with L = 1):
 * zxbcdt[B, I + X + H] = [z | x B C | dt], X = I + 2 G N. Writes
 *   conv_out[B, S, X]  the conv window shifted by the new input (S = taps - 1),
 *   ssm_out[B, H, P, N] exp(dt A) ssm_in + dt x (outer) B,
 *   y[B, I]            rmsnorm_per_group((ssm_out C + D x) * silu(z)) * norm_w,
 * with dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log), x B C = silu(causal conv).
 * xbc: scratch of B * X floats. */
void hl_mamba_step(const float *zxbcdt, const float *conv_in, const float *conv_w,
                   const float *conv_b, const float *dt_bias, const float *A_log, const float *Dp,
                   const float *norm_w, const float *ssm_in, float *conv_out, float *ssm_out,
                   float *y, float *xbc, long Bsz, long H, long P, long G, long N, long S,
                   float dt_min, float dt_max, float eps, int nthreads) {
  long I = H * P, X = I + 2 * G * N, R = H / G, Kt = S + 1, row = I + X + H;
  long gsize = I / G;
  for (long b = 0; b < Bsz; b++) {
    const float *in = zxbcdt + b * row;
    const float *cin = conv_in + b * S * X;
    float *cout = conv_out + b * S * X, *xb = xbc + b * X;
    int par = H * P * N >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (par)
    for (long c = 0; c < X; c++) {
      float v = in[I + c], acc = 0.f;
      for (long j = 0; j < S; j++) acc += cin[j * X + c] * conv_w[c * Kt + j];
      acc += v * conv_w[c * Kt + S];
      if (conv_b) acc += conv_b[c];
      xb[c] = silu(acc);
      for (long j = 0; j + 1 < S; j++) cout[j * X + c] = cin[(j + 1) * X + c];
      if (S > 0) cout[(S - 1) * X + c] = v;
    }
    const float *Bv = xb + I, *Cv = xb + I + G * N;
    float *yb = y + b * I;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (par)
    for (long h = 0; h < H; h++) {
      float d = in[I + X + h] + dt_bias[h];
      d = d > 20.f ? d : log1pf(expf(d)); /* softplus, torch's threshold 20 */
      if (d < dt_min) d = dt_min;
      if (d > dt_max) d = dt_max;
      float decay = expf(d * -expf(A_log[h]));
      long g = h / R;
      const float *Bg = Bv + g * N, *Cg = Cv + g * N;
      for (long p = 0; p < P; p++) {
        const float *s0 = ssm_in + ((b * H + h) * P + p) * N;
        float *s1 = ssm_out + ((b * H + h) * P + p) * N;
        float xv = xb[h * P + p], xdt = xv * d, acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (long k = 0; k < N; k++) {
          float s = s0[k] * decay + xdt * Bg[k];
          s1[k] = s;
          acc += s * Cg[k];
        }
        yb[h * P + p] = acc + Dp[h] * xv;
      }
    }
    const float *z = in;
    for (long g = 0; g < G; g++) {
      double ss = 0.0;
      for (long i = g * gsize; i < (g + 1) * gsize; i++) {
        float v = yb[i] * silu(z[i]);
        yb[i] = v;
        ss += (double)v * v;
      }
      float r = 1.f / sqrtf((float)(ss / gsize) + eps);
      for (long i = g * gsize; i < (g + 1) * gsize; i++) yb[i] = norm_w[i] * (yb[i] * r);
    }
  }
}

/* Causal grouped-query attention of L (few) query rows against S cached keys, fp32:
 * q[B, H, L, E], k / v [B, Kh, S, E] (row strides ldk / ldv between (b, kv-head) blocks, so the
 * valid prefix of a preallocated cache is read in place), o[B, H, L, E]. Query i sits at
 * position S - L + i and sees keys j <= S - L + i (and, with window > 0, S - L + i - j < window).
 * scores: scratch of B * H * S floats per query row, reused. */
void hl_attention(const float *q, const float *k, const float *v, float *o, float *scores,
                  long Bsz, long H, long Kh, long L, long S, long E, long ldk, long ldv,
                  long window, float scale, int nthreads) {
  long R = H / Kh;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static) if (Bsz * Kh * S * E >= PARALLEL_MIN_FLOATS)
  for (long b = 0; b < Bsz; b++)
    for (long h = 0; h < H; h++) {
      const float *kb = k + (b * Kh + h / R) * ldk, *vb = v + (b * Kh + h / R) * ldv;
      float *sc = scores + (b * H + h) * S;
      for (long i = 0; i < L; i++) {
        const float *qi = q + ((b * H + h) * L + i) * E;
        float *oi = o + ((b * H + h) * L + i) * E;
        long last = S - L + i, first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        float mx = -INFINITY;
        for (long j = first; j <= last; j++) {
          float d = 0.f;
          for (long e = 0; e < E; e++) d += qi[e] * kb[j * E + e];
          sc[j] = d * scale;
          if (sc[j] > mx) mx = sc[j];
        }
        double den = 0.0;
        for (long j = first; j <= last; j++) {
          sc[j] = expf(sc[j] - mx);
          den += sc[j];
        }
        float inv = (float)(1.0 / den);
        for (long e = 0; e < E; e++) oi[e] = 0.f;
        for (long j = first; j <= last; j++) {
          float w = sc[j] * inv;
          for (long e = 0; e < E; e++) oi[e] += w * vb[j * E + e];
        }
      }
    }
}

/* Sigmoid top-k router for T tokens (group-limited routing not included): scores = sigmoid(
 * logits[T, E]); experts = the top_k of scores + bias (ties to the lower index); gates = the
 * chosen scores, renormalised when norm (+1e-20), times scaling. */
void hl_route(const float *logits, const float *bias, int64_t *idx, float *gate, long T, long E,
              long top_k, int norm, float scaling) {
  for (long t = 0; t < T; t++) {
    float s[E], c[E];
    for (long e = 0; e < E; e++) {
      s[e] = 1.f / (1.f + expf(-logits[t * E + e]));
      c[e] = s[e] + bias[e];
    }
    float sum = 0.f;
    for (long r = 0; r < top_k; r++) {
      long best = -1;
      for (long e = 0; e < E; e++)
        if (c[e] != -INFINITY && (best < 0 || c[e] > c[best])) best = e;
      idx[t * top_k + r] = best;
      gate[t * top_k + r] = s[best];
      sum += s[best];
      c[best] = -INFINITY;
    }
    for (long r = 0; r < top_k; r++)
      gate[t * top_k + r] = (norm ? gate[t * top_k + r] / (sum + 1e-20f) : gate[t * top_k + r]) * scaling;
  }
}

/* ------------------------------------------------------------------ training kernels */

typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t)), aligned(4)));

static inline vf vsel(vi mask, vf a, vf b) { /* mask ? a : b, lanewise */
  return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp(x), lanewise: x = n ln2 + r with n = round(x / ln2) and r in [-ln2/2, ln2/2] (two-part
 * ln2, Cody-Waite), exp(r) by Cephes' expf polynomial (about 1 ulp), 2^n built in the exponent
 * bits. x is clamped to [-87.3, 88.4] (the finite, normal results). */
static inline vf vexp(vf x) {
  const vf hi = (vf){0} + 88.3762626647949f, lo = (vf){0} - 87.3365447505531f;
  x = vsel(x > hi, hi, x);
  x = vsel(x < lo, lo, x);
  vf t = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(t, vi);
  n += (vi)(__builtin_convertvector(n, vf) > t); /* truncation -> floor (true is -1) */
  vf nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = 1.9875691500E-4f * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.f;
  return p * (vf)((n + 127) << 23);
}

static inline vf vsigmoid(vf a) { return 1.f / (1.f + vexp(-a)); }

static inline vf vload(const float *p) {
  vf v;
  memcpy(&v, p, sizeof(vf));
  return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof(vf)); }

static inline int thread_id(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/* Causal depthwise conv + SiLU over whole sequences (Mamba2Mixer's conv over x B C):
 *   y[b, l, d] = silu(a[b, l, d]),  a = sum_k xp[b, l + k, d] w[k, d] + bias[d]
 * xp [B, T = L + K - 1, D] (the inputs after the S = K - 1 carried ones), w [K, D]. */
void hl_conv_silu_fwd(const float *xp, const float *w, const float *bias, float *y, long Bsz,
                      long L, long D, long K, int nthreads) {
  long T = L + K - 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (Bsz * L * D >= PARALLEL_MIN_FLOATS)
  for (long row = 0; row < Bsz * L; row++) {
    long b = row / L, l = row % L;
    const float *x0 = xp + (b * T + l) * D;
    float *yr = y + row * D;
    long d = 0;
    for (; d + VL <= D; d += VL) {
      vf a = bias ? vload(bias + d) : (vf){0};
      for (long k = 0; k < K; k++) a += vload(x0 + k * D + d) * vload(w + k * D + d);
      vstore(yr + d, a * vsigmoid(a));
    }
    for (; d < D; d++) {
      float a = bias ? bias[d] : 0.f;
      for (long k = 0; k < K; k++) a += x0[k * D + d] * w[k * D + d];
      yr[d] = a / (1.f + expf(-a));
    }
  }
}

/* Backward of hl_conv_silu_fwd given gy [B, L, D]. With a recomputed, s = sigmoid(a) and
 * da = gy s (1 + a (1 - s)):
 *   gxp[b, t, d] = sum_k da[b, t - k, d] w[k, d]  (0 <= t - k < L),
 *   gw[k, d] = sum_{b,l} da[b, l, d] xp[b, l + k, d],  gb[d] = sum_{b,l} da[b, l, d].
 * da: scratch [B, L, D]; part: zeroed [nthreads, K + 1, D] per-thread sums of gw (rows 0..K-1)
 * and gb (row K), which the caller adds up. */
void hl_conv_silu_bwd(const float *xp, const float *w, const float *bias, const float *gy,
                      float *gxp, float *da, float *part, long Bsz, long L, long D, long K,
                      int nthreads) {
  long T = L + K - 1;
  int par = Bsz * L * D >= PARALLEL_MIN_FLOATS;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    float *pw = part + (long)thread_id() * (K + 1) * D, *pb = pw + K * D;
#pragma omp for schedule(static)
    for (long row = 0; row < Bsz * L; row++) {
      long b = row / L, l = row % L;
      const float *x0 = xp + (b * T + l) * D, *g = gy + row * D;
      float *dr = da + row * D;
      long d = 0;
      for (; d + VL <= D; d += VL) {
        vf a = bias ? vload(bias + d) : (vf){0};
        for (long k = 0; k < K; k++) a += vload(x0 + k * D + d) * vload(w + k * D + d);
        vf s = vsigmoid(a);
        vf dv = vload(g + d) * s * (1.f + a * (1.f - s));
        vstore(dr + d, dv);
        for (long k = 0; k < K; k++) vstore(pw + k * D + d, vload(pw + k * D + d) + dv * vload(x0 + k * D + d));
        vstore(pb + d, vload(pb + d) + dv);
      }
      for (; d < D; d++) {
        float a = bias ? bias[d] : 0.f;
        for (long k = 0; k < K; k++) a += x0[k * D + d] * w[k * D + d];
        float s = 1.f / (1.f + expf(-a)), dv = g[d] * s * (1.f + a * (1.f - s));
        dr[d] = dv;
        for (long k = 0; k < K; k++) pw[k * D + d] += dv * x0[k * D + d];
        pb[d] += dv;
      }
    }
#pragma omp for schedule(static)
    for (long row = 0; row < Bsz * T; row++) {
      long b = row / T, t = row % T;
      float *gr = gxp + row * D;
      memset(gr, 0, sizeof(float) * D);
      for (long k = 0; k < K; k++) {
        long l = t - k;
        if (l < 0 || l >= L) continue;
        const float *dr = da + (b * L + l) * D, *wk = w + k * D;
        long d = 0;
        for (; d + VL <= D; d += VL) vstore(gr + d, vload(gr + d) + vload(dr + d) * vload(wk + d));
        for (; d < D; d++) gr[d] += dr[d] * wk[d];
      }
    }
  }
}

/* Group-gated RMSNorm over rows (Mamba-2's norm before out_proj, norm_before_gate=False):
 *   g = x silu(z),  y = w g rs,  rs = 1 / sqrt(mean_group(g^2) + eps)  per group of gs channels
 * x, z, y [M, I], w [I], rs [M, I / gs] (kept for the backward). */
void hl_gated_norm_fwd(const float *x, const float *z, const float *w, float *y, float *rs,
                       long M, long I, long gs, float eps, int nthreads) {
  long G = I / gs;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * I >= PARALLEL_MIN_FLOATS)
  for (long r = 0; r < M * G; r++) {
    const float *xr = x + r * gs, *zr = z + r * gs, *wr = w + (r % G) * gs;
    float *yr = y + r * gs;
    vf acc = {0};
    float tail = 0.f;
    long i = 0;
    for (; i + VL <= gs; i += VL) {
      vf zv = vload(zr + i), g = vload(xr + i) * zv * vsigmoid(zv);
      vstore(yr + i, g);
      acc += g * g;
    }
    for (; i < gs; i++) {
      float g = xr[i] * zr[i] / (1.f + expf(-zr[i]));
      yr[i] = g;
      tail += g * g;
    }
    float inv = 1.f / sqrtf((hsum(acc) + tail) / gs + eps);
    rs[r] = inv;
    for (i = 0; i < gs; i++) yr[i] *= inv * wr[i];
  }
}

/* Backward of hl_gated_norm_fwd given gy [M, I] and its rs. With n = g rs, e = gy w and
 * c = mean_group(e n): dg = rs (e - n c); gx = dg silu(z); gz = dg x s (1 + z (1 - s)),
 * s = sigmoid(z); gw = sum over rows of gy n. part: zeroed [nthreads, I] per-thread sums of
 * gw, which the caller adds up. */
void hl_gated_norm_bwd(const float *x, const float *z, const float *w, const float *rs,
                       const float *gy, float *gx, float *gz, float *part, long M, long I,
                       long gs, int nthreads) {
  long G = I / gs;
#pragma omp parallel num_threads(nthreads) if (M * I >= PARALLEL_MIN_FLOATS)
  {
    float *pw = part + (long)thread_id() * I;
#pragma omp for schedule(static)
    for (long r = 0; r < M * G; r++) {
      long off = r * gs, c0 = (r % G) * gs;
      const float *xr = x + off, *zr = z + off, *gr = gy + off, *wr = w + c0;
      float inv = rs[r];
      vf acc = {0};
      float tail = 0.f;
      long i = 0;
      for (; i + VL <= gs; i += VL) { /* c = mean(e n) */
        vf zv = vload(zr + i), n = vload(xr + i) * zv * vsigmoid(zv) * inv;
        acc += vload(gr + i) * vload(wr + i) * n;
      }
      for (; i < gs; i++) {
        float n = xr[i] * zr[i] / (1.f + expf(-zr[i])) * inv;
        tail += gr[i] * wr[i] * n;
      }
      float c = (hsum(acc) + tail) / gs;
      for (i = 0; i + VL <= gs; i += VL) {
        vf zv = vload(zr + i), xv = vload(xr + i), s = vsigmoid(zv), sz = zv * s;
        vf n = xv * sz * inv, gv = vload(gr + i);
        vf dg = inv * (gv * vload(wr + i) - n * c);
        vstore(gx + off + i, dg * sz);
        vstore(gz + off + i, dg * xv * s * (1.f + zv * (1.f - s)));
        vstore(pw + c0 + i, vload(pw + c0 + i) + gv * n);
      }
      for (; i < gs; i++) {
        float zv = zr[i], s = 1.f / (1.f + expf(-zv)), sz = zv * s, n = xr[i] * sz * inv;
        float dg = inv * (gr[i] * wr[i] - n * c);
        gx[off + i] = dg * sz;
        gz[off + i] = dg * xr[i] * s * (1.f + zv * (1.f - s));
        pw[c0 + i] += gr[i] * n;
      }
    }
  }
}
