// Fused CPU decode attention over one layer of the packed TQ4 cache.
//
// One call does a whole layer for one query token: rotate q, walk the packed range
// through the block table, fold in the float sink/window K/V, and rotate back.
// Jobs are (kv head x context chunk) for at::parallel_for (torch's own pool); each
// keeps an online softmax (max, sum, acc[G, D]) and partials merge by log-sum-exp.
//
// Packed scores run in the rotated domain: score = norm * dot(c[idx], R q), and the
// value sum accumulates norm * p * c[idx], rotated back once per head at the end.
// Byte j of a packed vector holds idx[j] (low nibble) and idx[j + D/2] (high
// nibble). With AVX-512 the 16-entry float codebook sits in one register and
// _mm512_permutexvar_ps (which reads only the low 4 bits of each index) looks up
// 16 coordinates per instruction.
//
// Built by gpu_cache/kernels/cpu_decode.py; a portable scalar path is used when
// the compiler does not target AVX-512.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 16;  // tokens per online-softmax step
// Token-heads below which one thread does it all: ~0.1 ms of work, where waking
// the pool (and, on a busy machine, waiting for a descheduled worker) costs more.
constexpr int64_t kParallelWork = 8192;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Layout {
  const uint8_t* kp;
  const uint8_t* vp;
  const float* kn;
  const float* vn;
  int64_t ps0, ps1, ps2;  // packed strides (bytes): block, position, head
  int64_t ns0, ns1, ns2;  // norm strides (floats)
  const int32_t* table;   // block ids of the packed range, in order
  int64_t block_size;
};

struct FloatSeg {
  const float* k;
  const float* v;
  int64_t ks0, vs0;  // row strides (floats); head stride is D
  int64_t rows;
};

// Per-job online-softmax state: m[G], l[G], acc[G][W].
struct Partial {
  float* m;
  float* l;
  float* acc;
};

// Offsets of tokens t..t+n-1 of kv head `head`: one division per tile, not per token.
inline void row_offsets(const Layout& L, int64_t head, int64_t t, int n, int64_t* poff,
                        int64_t* noff) {
  int64_t b = t / L.block_size, pos = t % L.block_size;
  for (int i = 0; i < n; ++i) {
    const int64_t blk = L.table[b];
    poff[i] = blk * L.ps0 + pos * L.ps1 + head * L.ps2;
    noff[i] = blk * L.ns0 + pos * L.ns1 + head * L.ns2;
    if (++pos == L.block_size) {
      pos = 0;
      ++b;
    }
  }
}

inline void softmax_tile(const float* s, int n, float* m, float* l, float* p) {
  // s: n scores (already scaled); p receives exp(s - m_new); returns alpha via m/l.
  float mx = *m;
  for (int i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  float alpha = std::exp(*m - mx);
  float sum = 0.f;
  for (int i = 0; i < n; ++i) {
    p[i] = std::exp(s[i] - mx);
    sum += p[i];
  }
  *l = *l * alpha + sum;
  *m = mx;
  p[kTile] = alpha;
}

#ifdef __AVX512F__
inline __m512 exp512(__m512 x) {
  // exp(x) for x <= 0: 2^n * P(r), |r| <= ln2/2, degree-6 Taylor (rel. err ~1e-7).
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 vectors -> one vector whose lane i is the sum of v[i]'s lanes.
inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// Packed job, AVX-512: NC chunks of 16 bytes per packed vector (the last one masked).
// qr: [G][2*NC*16] rotated, scaled query in split layout (lo half, then hi half,
// each zero-padded to NC*16). acc: [G][2*NC*16] in the same layout.
// GT > 0 fixes the group size at compile time, so the accumulators stay in
// registers for the whole job; GT == 0 takes G at run time (accumulators in memory).
template <int NC, int GT>
void packed_job_avx512(const Layout& L, int64_t head, int64_t t0, int64_t t1, int G_rt,
                       int half, const float* qr, const float* cent, Partial st) {
  constexpr int W = 2 * NC * 16;
  constexpr int GA = GT > 0 ? GT : 1;  // register accumulators when GT > 0
  const int G = GT > 0 ? GT : G_rt;
  const __m512 cb = _mm512_loadu_ps(cent);
  const int tail = half - (NC - 1) * 16;
  const __mmask16 tmask = static_cast<__mmask16>((1u << tail) - 1u);
  alignas(64) float norms[kTile];
  alignas(64) float vnorms[kTile];
  alignas(64) float wbuf[16][kTile];  // per head: probability * value norm
  alignas(64) float vrows[kTile][W];  // decoded V rows (run-time G path only)
  __m512 dots[16][kTile];  // per head: one partial-dot vector per token
  int64_t poff[kTile], noff[kTile];
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[GA][2 * NC];
  if (GT > 0) {
    for (int g = 0; g < GA; ++g)
      for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_loadu_ps(st.acc + g * W + 16 * c);
  }

  auto decode = [&](const uint8_t* src, __m512* dst) {
    for (int c = 0; c < NC; ++c) {
      __m128i bytes = (c < NC - 1 || tail == 16)
                          ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * c))
                          : _mm_maskz_loadu_epi8(tmask, src + 16 * c);
      __m512i idx = _mm512_cvtepu8_epi32(bytes);
      dst[c] = _mm512_permutexvar_ps(idx, cb);
      dst[NC + c] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), cb);
    }
  };

  for (int64_t t = t0; t < t1; t += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, t1 - t));
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    row_offsets(L, head, t, n, poff, noff);
    for (int i = 0; i < n; ++i) {
      __m512 k[2 * NC];
      decode(L.kp + poff[i], k);
      norms[i] = L.kn[noff[i]];
      vnorms[i] = L.vn[noff[i]];
      for (int g = 0; g < G; ++g) {
        const float* q = qr + g * W;
        __m512 a = _mm512_mul_ps(k[0], _mm512_loadu_ps(q));
        for (int c = 1; c < 2 * NC; ++c) a = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(q + 16 * c), a);
        dots[g][i] = a;
      }
    }
    for (int i = n; i < kTile; ++i) {
      norms[i] = 0.f;
      vnorms[i] = 0.f;
      for (int g = 0; g < G; ++g) dots[g][i] = zero;
    }
    const __m512 kn = _mm512_load_ps(norms);
    const __m512 vn = _mm512_load_ps(vnorms);
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_mul_ps(reduce16(dots[g]), kn);
      s = _mm512_mask_blend_ps(live, _mm512_set1_ps(kNegInf), s);
      const float m_old = st.m[g];
      const float m_new = std::max(m_old, _mm512_reduce_max_ps(s));
      const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      if (m_new != m_old) {
        const float a = std::exp(m_old - m_new);
        st.l[g] *= a;
        const __m512 av = _mm512_set1_ps(a);
        if (GT > 0) {
          for (int c = 0; c < 2 * NC; ++c) acc[g < GA ? g : 0][c] = _mm512_mul_ps(acc[g < GA ? g : 0][c], av);
        } else {
          float* ag = st.acc + g * W;
          for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(ag + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), av));
        }
      }
      st.l[g] += _mm512_reduce_add_ps(p);
      st.m[g] = m_new;
      _mm512_store_ps(wbuf[g], _mm512_mul_ps(p, vn));
    }
    if (GT > 0) {
      for (int i = 0; i < n; ++i) {
        __m512 v[2 * NC];
        decode(L.vp + poff[i], v);
        for (int g = 0; g < GA; ++g) {
          const __m512 wi = _mm512_set1_ps(wbuf[g][i]);
          for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_fmadd_ps(wi, v[c], acc[g][c]);
        }
      }
    } else {
      for (int i = 0; i < n; ++i) {
        __m512 v[2 * NC];
        decode(L.vp + poff[i], v);
        for (int c = 0; c < 2 * NC; ++c) _mm512_store_ps(vrows[i] + 16 * c, v[c]);
      }
      for (int g = 0; g < G; ++g) {
        float* ag = st.acc + g * W;
        __m512 av[2 * NC];
        for (int c = 0; c < 2 * NC; ++c) av[c] = _mm512_loadu_ps(ag + 16 * c);
        for (int i = 0; i < n; ++i) {
          const __m512 wi = _mm512_set1_ps(wbuf[g][i]);
          for (int c = 0; c < 2 * NC; ++c) av[c] = _mm512_fmadd_ps(wi, _mm512_load_ps(vrows[i] + 16 * c), av[c]);
        }
        for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(ag + 16 * c, av[c]);
      }
    }
  }
  if (GT > 0) {
    for (int g = 0; g < GA; ++g)
      for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(st.acc + g * W + 16 * c, acc[g][c]);
  }
}

template <int NC>
bool packed_job_nc(const Layout& L, int64_t head, int64_t t0, int64_t t1, int G, int half,
                   const float* qr, const float* cent, Partial st) {
  switch (G) {
    case 1: packed_job_avx512<NC, 1>(L, head, t0, t1, G, half, qr, cent, st); return true;
    case 2: packed_job_avx512<NC, 2>(L, head, t0, t1, G, half, qr, cent, st); return true;
    case 3: packed_job_avx512<NC, 3>(L, head, t0, t1, G, half, qr, cent, st); return true;
    case 4: packed_job_avx512<NC, 4>(L, head, t0, t1, G, half, qr, cent, st); return true;
    default: packed_job_avx512<NC, 0>(L, head, t0, t1, G, half, qr, cent, st); return true;
  }
}
#endif  // __AVX512F__

// Packed job, portable scalar path (same layout as the AVX-512 one, W = 2*NCp).
void packed_job_scalar(const Layout& L, int64_t head, int64_t t0, int64_t t1, int G, int half,
                       int W, const float* qr, const float* cent, Partial st) {
  const int hw = W / 2;
  std::vector<float> kbuf(static_cast<size_t>(W)), s(kTile), p(kTile + 1), wn(kTile);
  std::vector<float> vbuf(static_cast<size_t>(kTile) * W);
  for (int64_t t = t0; t < t1; t += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, t1 - t));
    std::vector<float> scores(static_cast<size_t>(G) * kTile);
    int64_t poff[kTile], noff[kTile];
    row_offsets(L, head, t, n, poff, noff);
    for (int i = 0; i < n; ++i) {
      const uint8_t* kp = L.kp + poff[i];
      const uint8_t* vp = L.vp + poff[i];
      std::fill(kbuf.begin(), kbuf.end(), 0.f);
      float* vrow = vbuf.data() + static_cast<size_t>(i) * W;
      std::fill(vrow, vrow + W, 0.f);
      for (int j = 0; j < half; ++j) {
        kbuf[j] = cent[kp[j] & 15];
        kbuf[hw + j] = cent[kp[j] >> 4];
        vrow[j] = cent[vp[j] & 15];
        vrow[hw + j] = cent[vp[j] >> 4];
      }
      const float kn = L.kn[noff[i]];
      wn[i] = L.vn[noff[i]];
      for (int g = 0; g < G; ++g) {
        const float* q = qr + g * W;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int j = 0; j < W; ++j) a += kbuf[j] * q[j];
        scores[g * kTile + i] = a * kn;
      }
    }
    for (int g = 0; g < G; ++g) {
      softmax_tile(&scores[g * kTile], n, &st.m[g], &st.l[g], p.data());
      float* acc = st.acc + g * W;
      const float alpha = p[kTile];
      for (int j = 0; j < W; ++j) acc[j] *= alpha;
      for (int i = 0; i < n; ++i) {
        const float wi = p[i] * wn[i];
        const float* vrow = vbuf.data() + static_cast<size_t>(i) * W;
        for (int j = 0; j < W; ++j) acc[j] += wi * vrow[j];
      }
    }
  }
}

// Float job: rows of one segment for one kv head, original domain (q unrotated).
void float_job(const FloatSeg& f, int64_t head, int64_t r0, int64_t r1, int G, int D,
               const float* q, int W, Partial st) {
  std::vector<float> s(static_cast<size_t>(G) * kTile), p(kTile + 1);
  for (int64_t r = r0; r < r1; r += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, r1 - r));
    for (int i = 0; i < n; ++i) {
      const float* k = f.k + (r + i) * f.ks0 + head * D;
      for (int g = 0; g < G; ++g) {
        const float* qg = q + g * W;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int d = 0; d < D; ++d) a += qg[d] * k[d];
        s[g * kTile + i] = a;
      }
    }
    for (int g = 0; g < G; ++g) {
      softmax_tile(&s[g * kTile], n, &st.m[g], &st.l[g], p.data());
      float* acc = st.acc + g * W;
      const float alpha = p[kTile];
      for (int d = 0; d < D; ++d) acc[d] *= alpha;
      for (int i = 0; i < n; ++i) {
        const float* v = f.v + (r + i) * f.vs0 + head * D;
        const float wi = p[i];
        for (int d = 0; d < D; ++d) acc[d] += wi * v[d];
      }
    }
  }
}

struct Job {
  int64_t head, t0, t1;
  int seg;  // -1: packed range; else float segment index
};

void check(bool ok, const char* msg) { TORCH_CHECK(ok, msg); }

std::tuple<at::Tensor, at::Tensor> tq4_decode(
    const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_norms,
    const at::Tensor& v_packed, const at::Tensor& v_norms, const at::Tensor& block_table,
    int64_t first_block, int64_t num_tokens, const at::Tensor& rotation,
    const at::Tensor& centroids, double scale_d, at::TensorList float_k,
    at::TensorList float_v) {
  check(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(),
        "q must be contiguous float32 [Hq, D]");
  check(k_packed.dim() == 4 && k_packed.scalar_type() == at::kByte && k_packed.stride(3) == 1,
        "k_packed must be uint8 [NB, BS, Hkv, D/2] with a contiguous last dim");
  check(v_packed.sizes() == k_packed.sizes() && v_packed.strides() == k_packed.strides(),
        "v_packed must match k_packed");
  check(k_norms.dim() == 3 && k_norms.scalar_type() == at::kFloat &&
            v_norms.strides() == k_norms.strides(),
        "norms must be float32 [NB, BS, Hkv] with equal strides");
  check(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
        "block_table must be contiguous int32");
  check(rotation.scalar_type() == at::kFloat && rotation.is_contiguous(), "rotation: float32");
  check(centroids.scalar_type() == at::kFloat && centroids.numel() == 16, "16 centroids");
  check(float_k.size() == float_v.size(), "float_k and float_v differ in length");
  const int64_t Hq = q.size(0), D = q.size(1);
  const int64_t Hkv = k_packed.size(2), half = k_packed.size(3);
  check(D % 2 == 0 && half * 2 == D && Hq % Hkv == 0, "shapes disagree");
  const int G = static_cast<int>(Hq / Hkv);
  check(G <= 16, "at most 16 query heads per kv head");
  const int NC = static_cast<int>((half + 15) / 16);
  const int W = 2 * NC * 16;  // >= D: each half padded to whole 16-lane chunks
  const float scale = static_cast<float>(scale_d);
  check(num_tokens >= 0 &&
            (num_tokens == 0 ||
             first_block + (num_tokens + k_packed.size(1) - 1) / k_packed.size(1) <=
                 block_table.numel()),
        "num_tokens does not fit the block table");

  std::vector<FloatSeg> segs;
  for (size_t i = 0; i < float_k.size(); ++i) {
    const at::Tensor& fk = float_k[i];
    const at::Tensor& fv = float_v[i];
    check(fk.dim() == 3 && fk.size(1) == Hkv && fk.size(2) == D && fk.scalar_type() == at::kFloat &&
              fk.stride(2) == 1 && fk.stride(1) == D,
          "float_k must be float32 [F, Hkv, D] with contiguous rows");
    check(fv.sizes() == fk.sizes() && fv.scalar_type() == at::kFloat && fv.stride(2) == 1 &&
              fv.stride(1) == D,
          "float_v must match float_k");
    if (fk.size(0) == 0) continue;
    segs.push_back({fk.data_ptr<float>(), fv.data_ptr<float>(), fk.stride(0), fv.stride(0),
                    fk.size(0)});
  }

  // Rotated, scaled queries in split layout (padded), and scaled queries as they are.
  const float* R = rotation.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  std::vector<float> qr(static_cast<size_t>(Hq) * W, 0.f), qs(static_cast<size_t>(Hq) * W, 0.f);
  const int hw = NC * 16;
  std::vector<float> rt(static_cast<size_t>(D) * D), rq(static_cast<size_t>(D));
  for (int64_t j = 0; j < D; ++j)
    for (int64_t d = 0; d < D; ++d) rt[d * D + j] = R[j * D + d];
  for (int64_t h = 0; h < Hq; ++h) {
    const float* qh = qp + h * D;
    std::fill(rq.begin(), rq.end(), 0.f);
    for (int64_t d = 0; d < D; ++d) {  // (R q)[j] = sum_d R[j, d] q[d], vectorized over j
      const float qd = qh[d];
      const float* col = rt.data() + d * D;
      for (int64_t j = 0; j < D; ++j) rq[j] += col[j] * qd;
    }
    for (int64_t j = 0; j < D; ++j) {
      const int64_t slot = j < half ? j : hw + (j - half);
      qr[h * W + slot] = rq[j] * scale;
      qs[h * W + j] = qh[j] * scale;
    }
  }

  // Jobs: packed chunks per head, then one job per (float segment, head).
  std::vector<Job> jobs;
  const int threads = at::get_num_threads();
  int64_t chunk = num_tokens;
  if (threads > 1 && num_tokens * Hkv >= kParallelWork) {
    // 4 chunks per thread and head: Hkv * 4 * threads equal jobs split evenly.
    const int64_t want = 4 * static_cast<int64_t>(threads);
    chunk = std::max<int64_t>(256, (num_tokens + want - 1) / want);
    chunk = (chunk + kTile - 1) / kTile * kTile;
  }
  // Chunk-major: the heads of one chunk share cache lines, so they run back to back.
  for (int64_t t = 0; t < num_tokens; t += chunk) {
    for (int64_t h = 0; h < Hkv; ++h) jobs.push_back({h, t, std::min(t + chunk, num_tokens), -1});
  }
  for (size_t s = 0; s < segs.size(); ++s) {
    for (int64_t h = 0; h < Hkv; ++h) jobs.push_back({h, 0, segs[s].rows, static_cast<int>(s)});
  }
  const int64_t nj = static_cast<int64_t>(jobs.size());
  std::vector<float> pm(static_cast<size_t>(nj) * G, kNegInf), pl(static_cast<size_t>(nj) * G, 0.f);
  std::vector<float> pacc(static_cast<size_t>(nj) * G * W, 0.f);

  Layout L{k_packed.data_ptr<uint8_t>(), v_packed.data_ptr<uint8_t>(), k_norms.data_ptr<float>(),
           v_norms.data_ptr<float>(), k_packed.stride(0), k_packed.stride(1), k_packed.stride(2),
           k_norms.stride(0), k_norms.stride(1), k_norms.stride(2),
           block_table.data_ptr<int32_t>() + first_block, k_packed.size(1)};
  const float* cent = centroids.data_ptr<float>();

  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const Job& job = jobs[j];
      Partial st{pm.data() + j * G, pl.data() + j * G, pacc.data() + j * G * W};
      if (job.seg >= 0) {
        float_job(segs[job.seg], job.head, job.t0, job.t1, G, static_cast<int>(D),
                  qs.data() + job.head * G * W, W, st);
        continue;
      }
      const float* qh = qr.data() + job.head * G * W;
#ifdef __AVX512F__
      switch (NC) {
        case 1: packed_job_nc<1>(L, job.head, job.t0, job.t1, G, half, qh, cent, st); continue;
        case 2: packed_job_nc<2>(L, job.head, job.t0, job.t1, G, half, qh, cent, st); continue;
        case 4: packed_job_nc<4>(L, job.head, job.t0, job.t1, G, half, qh, cent, st); continue;
        default: break;
      }
#endif
      packed_job_scalar(L, job.head, job.t0, job.t1, G, static_cast<int>(half), W, qh, cent, st);
    }
  };
  if (nj > 1 && num_tokens * Hkv >= kParallelWork) {
    at::parallel_for(0, nj, 1, run);
  } else {
    run(0, nj);
  }

  // Merge: packed partials per head (rotated domain) -> rotate back -> merge floats.
  at::Tensor out = at::empty({Hq, D}, q.options());
  at::Tensor lse = at::empty({Hq}, q.options());
  float* po = out.data_ptr<float>();
  float* plse = lse.data_ptr<float>();
  std::vector<float> rot_acc(static_cast<size_t>(W)), orig(static_cast<size_t>(D));
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int g = 0; g < G; ++g) {
      float m = kNegInf;
      for (int64_t j = 0; j < nj; ++j)
        if (jobs[j].head == h) m = std::max(m, pm[j * G + g]);
      float l = 0.f;
      std::fill(rot_acc.begin(), rot_acc.end(), 0.f);
      std::fill(orig.begin(), orig.end(), 0.f);
      bool any_packed = false;
      for (int64_t j = 0; j < nj; ++j) {
        if (jobs[j].head != h || pl[j * G + g] == 0.f) continue;
        const float w = std::exp(pm[j * G + g] - m);
        l += pl[j * G + g] * w;
        const float* a = pacc.data() + (j * G + g) * W;
        if (jobs[j].seg < 0) {
          any_packed = true;
          for (int i = 0; i < W; ++i) rot_acc[i] += a[i] * w;
        } else {
          for (int64_t d = 0; d < D; ++d) orig[d] += a[d] * w;
        }
      }
      if (any_packed) {  // orig += rot_acc @ R (unsplit the layout on the way)
        for (int64_t j = 0; j < D; ++j) {
          const float a = rot_acc[j < half ? j : hw + (j - half)];
          if (a == 0.f) continue;
          const float* row = R + j * D;
          for (int64_t d = 0; d < D; ++d) orig[d] += a * row[d];
        }
      }
      const int64_t qh = h * G + g;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t d = 0; d < D; ++d) po[qh * D + d] = orig[d] * inv;
      plse[qh] = l > 0.f ? m + std::log(l) : kNegInf;
    }
  }
  return {out, lse};
}


// Encode new K/V rows straight into their cache slots, as TQ4Codec.encode does on
// the torch path (norm, divide, rotate by the dense R, bucketize, length-correct,
// pack). Used for the few rows of a decode step, where the torch path's dozen ops
// per layer cost more than the work. Keys have the layer's offset subtracted first.
void encode_rows(const at::Tensor& x, const float* offset, const int64_t* slots,
                 const at::Tensor& packed, const at::Tensor& norms, const float* R,
                 const float* bounds, int64_t num_bounds, const float* cent) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t bs = packed.size(1);
  const int64_t nslots = packed.size(0) * bs;
  const float* xp = x.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  float* np_ = norms.data_ptr<float>();
  std::vector<float> u(static_cast<size_t>(D)), r(static_cast<size_t>(D));
  std::vector<uint8_t> idx(static_cast<size_t>(D));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < nslots, "slot beyond the cache layer");
    const int64_t blk = slot / bs, pos = slot % bs;
    for (int64_t h = 0; h < H; ++h) {
      const float* xv = xp + (t * H + h) * D;
      float sq = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        u[d] = offset ? xv[d] - offset[h * D + d] : xv[d];
        sq += u[d] * u[d];
      }
      const float n = std::sqrt(sq);
      for (int64_t d = 0; d < D; ++d) u[d] = n > 0.f ? u[d] / n : 0.f;
      float recon = 0.f;
      for (int64_t j = 0; j < D; ++j) {  // r = u @ R.T: r[j] = sum_d R[j, d] u[d]
        const float* row = R + j * D;
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += row[d] * u[d];
        int k = 0;
        for (int64_t b = 0; b < num_bounds; ++b) k += acc > bounds[b];
        idx[j] = static_cast<uint8_t>(k);
        recon += cent[k] * cent[k];
      }
      uint8_t* dst = pp + blk * packed.stride(0) + pos * packed.stride(1) + h * packed.stride(2);
      for (int64_t j = 0; j < half; ++j) dst[j] = idx[j] | static_cast<uint8_t>(idx[j + half] << 4);
      np_[blk * norms.stride(0) + pos * norms.stride(1) + h * norms.stride(2)] =
          n > 0.f ? n / std::sqrt(recon) : 0.f;
    }
  }
}

void tq4_encode(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
                const at::Tensor& k_packed, const at::Tensor& k_norms,
                const at::Tensor& v_packed, const at::Tensor& v_norms,
                const at::Tensor& rotation, const at::Tensor& boundaries,
                const at::Tensor& centroids, const c10::optional<at::Tensor>& key_offset) {
  check(key.dim() == 3 && key.scalar_type() == at::kFloat && key.is_contiguous(),
        "key must be contiguous float32 [T, Hkv, D]");
  check(value.sizes() == key.sizes() && value.scalar_type() == at::kFloat &&
            value.is_contiguous(),
        "value must match key");
  check(slots.dim() == 1 && slots.size(0) == key.size(0) && slots.scalar_type() == at::kLong &&
            slots.is_contiguous(),
        "slots must be contiguous int64 [T]");
  for (const at::Tensor* p : {&k_packed, &v_packed})
    check(p->dim() == 4 && p->scalar_type() == at::kByte && p->stride(3) == 1 &&
              p->size(2) == key.size(1) && p->size(3) * 2 == key.size(2),
          "packed must be uint8 [NB, BS, Hkv, D/2] with a contiguous last dim");
  for (const at::Tensor* p : {&k_norms, &v_norms})
    check(p->dim() == 3 && p->scalar_type() == at::kFloat && p->size(0) == k_packed.size(0) &&
              p->size(1) == k_packed.size(1) && p->size(2) == key.size(1),
          "norms must be float32 [NB, BS, Hkv]");
  const int64_t D = key.size(2);
  check(rotation.scalar_type() == at::kFloat && rotation.is_contiguous() &&
            rotation.numel() == D * D,
        "rotation: float32 [D, D]");
  check(boundaries.scalar_type() == at::kFloat && boundaries.is_contiguous() &&
            boundaries.numel() == 15,
        "15 boundaries");
  check(centroids.scalar_type() == at::kFloat && centroids.numel() == 16, "16 centroids");
  const float* off = nullptr;
  if (key_offset.has_value() && key_offset->defined()) {
    check(key_offset->scalar_type() == at::kFloat && key_offset->is_contiguous() &&
              key_offset->numel() == key.size(1) * D,
          "key_offset: contiguous float32 [Hkv, D]");
    off = key_offset->data_ptr<float>();
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* R = rotation.data_ptr<float>();
  const float* b = boundaries.data_ptr<float>();
  const float* c = centroids.data_ptr<float>();
  encode_rows(key, off, sp, k_packed, k_norms, R, b, 15, c);
  encode_rows(value, nullptr, sp, v_packed, v_norms, R, b, 15, c);
}

}  // namespace

TORCH_LIBRARY(contextkit_cpu, m) {
  m.def(
      "tq4_decode(Tensor q, Tensor k_packed, Tensor k_norms, Tensor v_packed, Tensor v_norms, "
      "Tensor block_table, int first_block, int num_tokens, Tensor rotation, Tensor centroids, "
      "float scale, Tensor[] float_k, Tensor[] float_v) -> (Tensor, Tensor)",
      &tq4_decode);
  m.def(
      "tq4_encode(Tensor key, Tensor value, Tensor slots, Tensor(a!) k_packed, "
      "Tensor(b!) k_norms, Tensor(c!) v_packed, Tensor(d!) v_norms, Tensor rotation, "
      "Tensor boundaries, Tensor centroids, Tensor? key_offset) -> ()",
      &tq4_encode);
}
