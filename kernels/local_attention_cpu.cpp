// Fused local attention on the CPU: ViL's 2D windows and Longformer's 1D sliding window.
//
// 2D: one query chunk (w x w queries) of one (batch, head) at a time: its keys, the blocks of the chunks its
// queries see (the "slots"), and the G global keys are copied into small buffers, and the whole softmax of
// the chunk runs on an S x (L + G) score matrix that stays in the core's cache. The matrix products are BLAS
// calls on those buffers (sgemm_/dgemm_, which torch's CPU library exports); the masking, the bias tables
// and the softmax are loops over one score row at a time.
//
// 1D: the positions r, r+d, r+2d, ... of a head with dilation d (one residue class r) form a sequence of their
// own, on which the window is the undilated one. One block of consecutive queries of such a sequence at a
// time: the keys their windows cover are one span of that sequence (at most block + 2w keys, block + w
// causal), copied with the G global keys into the same buffers as in 2D; the band, the causal and padding
// masks and the bias table are applied row by row.
//
// Forward: saves the output and the base-2 log-sum-exp of every query; chunks (blocks) run in parallel.
// Backward: recomputes the probabilities from the log-sum-exp; the chunks of one (batch, head), or the blocks
// of one residue class of one (batch, head), run in order on one thread, so that the key, value and bias
// gradients they share are added without races.
//
// Types: q, k, v, the output, the output's gradient and q, k, v's gradients are in the storage type S (float,
// double, bfloat16 or half); everything else, the buffers and the sums, in the compute type T (double for double,
// else float). Half precision is converted to float as the buffers are filled and back as results are written,
// and the key and value gradients of half precision are summed in float.
//
// Scores are in base 2 (queries times scale * log2(e), biases times log2(e) by the caller), so that the
// softmax needs exp2 only. q, k, v, the output and their gradients may be strided, with the elements of one
// token contiguous. 2D: (B, H, X, Y, D), lse (B, H, X, Y) contiguous; global_k, global_v (B, H, G, D) contiguous;
// rel_bias (H, (4w-1)^2) or empty; global_bias (H, G) or empty; slots (C, n, 3) int64: for each chunk
// (row-major) and neighbour slot, the chunk it reads (-1: none) and the slot's chunk offset (a, b), which the
// relative bias uses as if neighbour chunks were adjacent. 1D: (B, H, L, D), lse (B, H, L); rel_bias (H, 2w+1)
// or empty; key_padding_mask (B, L) bool or empty; one dilation per head.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*);
}

namespace {

constexpr int kMaxSlots = 9;
constexpr double kLog2e = 1.4426950408889634;

// Row-major c (m x n) = alpha * op(a) op(b) + beta * c; op(a) is m x k, op(b) k x n; trans_a: a is stored k x m.
// BLAS is column-major: the row-major product is the column-major c^T = op(b)^T op(a)^T.
template <typename T>
void matmul(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b, int ldb,
            T beta, T* c, int ldc) {
  const char op_a = trans_a ? 'T' : 'N', op_b = trans_b ? 'T' : 'N';
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&op_b, &op_a, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  } else {
    dgemm_(&op_b, &op_a, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  }
}

// exp2 for t <= 0 (scores less their maximum or log-sum-exp): 2^round(t) times a degree-6 polynomial of the
// remainder, about 1 ulp. Written so that the compiler vectorises a loop over it; t <= -127 (and -inf) gives 0,
// since 2^-127 has a zero exponent field.
inline float exp2_nonpositive(float t) {
  t = std::max(t, -127.0f);
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.6931471805599453f;  // 2^(t-n) = e^f, |f| <= ln(2)/2
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline double exp2_nonpositive(double t) { return std::exp2(t); }

// Replaces one row of base-2 scores by 2^(score - its maximum), and gives the maximum and the sum. A row that sees
// no key (all -inf) becomes zeros, with sum 0.
template <typename T>
void exponentiate_row(T* row, int n, T& max, T& sum) {
  T m = row[0], s = 0;
#pragma omp simd reduction(max : m)
  for (int j = 0; j < n; ++j) m = m > row[j] ? m : row[j];  // std::max does not vectorise
  if (m == -std::numeric_limits<T>::infinity()) m = 0;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < n; ++j) {
    row[j] = exp2_nonpositive(row[j] - m);
    s += row[j];
  }
  max = m;
  sum = s;
}

// A value of the storage type in the compute type, and back (rounding to nearest even). bfloat16 is the upper half
// of a float: widened and narrowed with integer operations, which the compiler vectorises (c10's conversion
// checks for NaN first, which it does not).
template <typename T, typename S>
inline T widen(S x) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<T>(x);
  }
}

template <typename S, typename T>
inline S narrow(T x) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
  } else {
    return static_cast<S>(x);
  }
}

// One query's output (its unnormalised output o over the row sum) and base-2 log-sum-exp. A query that sees no
// key outputs zeros, and its log-sum-exp is +inf, so that the backward's probabilities 2^(s - lse) are zeros.
template <typename S, typename T>
void store_output(S* out, T* lse, const T* o, int64_t D, T max, T sum) {
  const T inverse = sum > 0 ? T(1) / sum : T(0);
  for (int64_t d = 0; d < D; ++d) out[d] = narrow<S>(o[d] * inverse);
  *lse = sum > 0 ? max + std::log2(sum) : std::numeric_limits<T>::infinity();
}

// One (batch, head) of a (B, H, X, Y, D) map or a (B, H, L, D) sequence: the D elements of a token are contiguous,
// tokens are `row` apart from one row (position) to the next and `col` apart from one column to the next (1D: 0).
template <typename S>
struct Map {
  S* data;
  int64_t row, col;
  S* at(int64_t r, int64_t c) const { return data + r * row + c * col; }
  // Residue class r of a dilation d of a sequence: its positions r, r + d, ... as the rows of a map.
  Map every(int64_t r, int64_t d) const { return {data + r * row, d * row, col}; }
};

template <typename S>
Map<S> map_of(const at::Tensor& t, int64_t b, int64_t h) {
  S* head = static_cast<S*>(t.data_ptr()) + b * t.stride(0) + h * t.stride(1);
  return {head, t.stride(2), t.dim() == 5 ? t.stride(3) : 0};
}

// dst (rows x cols tokens of D elements, row-major, contiguous) = factor * the block of src from token (r0, c0).
template <typename T, typename S>
void gather(T* dst, Map<const S> src, int64_t r0, int64_t c0, int64_t rows, int64_t cols, int64_t D, T factor) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const S* in = src.at(r0 + r, c0 + c);
      T* out = dst + (r * cols + c) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = widen<T>(in[d]) * factor;
    }
  }
}

// The block of dst from token (r0, c0) = src (rows x cols tokens, contiguous), or += src when `add`.
template <typename S, typename T>
void scatter(Map<S> dst, int64_t r0, int64_t c0, int64_t rows, int64_t cols, int64_t D, const T* src, bool add) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      S* out = dst.at(r0 + r, c0 + c);
      const T* in = src + (r * cols + c) * D;
      if (add) {
        for (int64_t d = 0; d < D; ++d) out[d] = narrow<S>(widen<T>(out[d]) + in[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) out[d] = narrow<S>(in[d]);
      }
    }
  }
}

// Adds n elements of src into dst.
template <typename T>
void add_into(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// Where a backward sums the key or value gradients of one (batch, head) map or residue class, from zero: the
// gradient tensor itself when it holds the compute type; else a buffer in the compute type, written to the tensor
// by finish (sums in half precision would lose the small terms). Either way the tensor needs no zeroing before.
template <typename S, typename T>
struct GradientSum {
  Map<T> target{};
  Map<S> out{};
  std::vector<T> buffer;
  int64_t rows = 0, cols = 0, D = 0;

  void start(Map<S> gradient, int64_t rows_, int64_t cols_, int64_t D_) {
    out = gradient, rows = rows_, cols = cols_, D = D_;
    if constexpr (std::is_same_v<S, T>) {
      target = gradient;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) std::fill(target.at(r, c), target.at(r, c) + D, T(0));
      }
    } else {
      buffer.assign(rows * cols * D, T(0));
      target = {buffer.data(), cols * D, D};
    }
  }
  void finish() {
    if constexpr (!std::is_same_v<S, T>) scatter(out, 0, 0, rows, cols, D, buffer.data(), false);
  }
};

struct Geometry {
  int64_t B, H, X, Y, D, G;
  int w, exact, chunk_cols, num_slots;
  int64_t chunks() const { return ((X + w - 1) / w) * chunk_cols; }
};

// One query chunk: its queries (rows q_r0.., columns q_c0..) and the key block of each slot it reads, laid out
// slot after slot, row-major within a slot, from score column `start`.
struct Chunk {
  int q_r0, q_c0, q_rows, q_cols;
  int slots = 0, keys = 0;
  int k_r0[kMaxSlots], k_c0[kMaxSlots], k_rows[kMaxSlots], k_cols[kMaxSlots];
  int a[kMaxSlots], b[kMaxSlots], start[kMaxSlots];
  int queries() const { return q_rows * q_cols; }
};

Chunk make_chunk(const Geometry& g, const int64_t* slot_table, int64_t chunk) {
  Chunk c;
  const int w = g.w;
  c.q_r0 = static_cast<int>(chunk / g.chunk_cols) * w;
  c.q_c0 = static_cast<int>(chunk % g.chunk_cols) * w;
  c.q_rows = std::min<int>(w, g.X - c.q_r0);
  c.q_cols = std::min<int>(w, g.Y - c.q_c0);
  for (int s = 0; s < g.num_slots; ++s) {
    const int64_t* entry = slot_table + (chunk * g.num_slots + s) * 3;
    if (entry[0] < 0) continue;
    const int i = c.slots++;
    c.k_r0[i] = static_cast<int>(entry[0] / g.chunk_cols) * w;
    c.k_c0[i] = static_cast<int>(entry[0] % g.chunk_cols) * w;
    c.k_rows[i] = std::min<int>(w, g.X - c.k_r0[i]);
    c.k_cols[i] = std::min<int>(w, g.Y - c.k_c0[i]);
    c.a[i] = static_cast<int>(entry[1]);
    c.b[i] = static_cast<int>(entry[2]);
    c.start[i] = c.keys;
    c.keys += c.k_rows[i] * c.k_cols[i];
  }
  return c;
}

// Calls fn(first key, length, bias row of the first key) for each run of keys that query (qi, qj) of the chunk
// (in-chunk row and column) sees, in increasing key order; along a run the bias row decreases by one per key.
template <typename F>
void for_each_visible_run(const Geometry& g, const Chunk& c, int qi, int qj, F&& fn) {
  const int w = g.w, side = 4 * w - 1;
  for (int s = 0; s < c.slots; ++s) {
    const int dj0 = qj - c.b[s] * w;  // column offset to the slot's key column kj: dj0 - kj
    for (int ki = 0; ki < c.k_rows[s]; ++ki) {
      const int di = qi - ki - c.a[s] * w;
      int lo = 0, hi = c.k_cols[s];
      if (g.exact == 1) {
        if (di < -w || di > w) continue;
        lo = std::max(lo, dj0 - w);
        hi = std::min(hi, dj0 + w + 1);
        if (lo >= hi) continue;
      }
      fn(c.start[s] + ki * c.k_cols[s] + lo, hi - lo, (di + 2 * w - 1) * side + (dj0 - lo + 2 * w - 1));
    }
  }
}

struct Geometry1d {
  int64_t B, H, L, D, G;
  int w, block;
  bool causal;
  std::vector<int64_t> dilations;  // one per head
  int64_t residues;                // the most residue classes of a head, min(d, L): partial sums per (batch, head)
  // The most keys a block's windows cover.
  int64_t span() const { return std::min<int64_t>(block + (causal ? 1 : 2) * w, L); }
};

// A block of queries t0 <= t < t0 + queries of residue class r of head h (positions r + d*t), and the span of
// keys k0 <= t < k0 + keys that their windows cover.
struct Block {
  int64_t h, d, r, t0, k0;
  int queries, keys;
};

// The blocks of one batch entry, by head, residue class and position; runs[i] is where the i-th (head, residue
// class) begins, and runs.back() the end.
std::vector<Block> make_blocks(const Geometry1d& g, std::vector<int64_t>& runs) {
  std::vector<Block> blocks;
  for (int64_t h = 0; h < g.H; ++h) {
    const int64_t d = g.dilations[h];
    for (int64_t r = 0; r < std::min(d, g.L); ++r) {
      runs.push_back(static_cast<int64_t>(blocks.size()));
      const int64_t n = (g.L - r + d - 1) / d;
      for (int64_t t0 = 0; t0 < n; t0 += g.block) {
        const int64_t queries = std::min<int64_t>(g.block, n - t0), k0 = std::max<int64_t>(0, t0 - g.w);
        const int64_t k1 = std::min(n, t0 + queries + (g.causal ? 0 : g.w));
        blocks.push_back({h, d, r, t0, k0, static_cast<int>(queries), static_cast<int>(k1 - k0)});
      }
    }
  }
  runs.push_back(static_cast<int64_t>(blocks.size()));
  return blocks;
}

// The window of query i of a block, before the padding mask: columns lo <= j < hi of its span, and the bias row
// of key lo; the bias row grows by one per key.
struct Band {
  int lo, hi, bias_row;
};

Band band_of(const Geometry1d& g, const Block& blk, int i) {
  const int64_t t = blk.t0 + i;
  const int lo = static_cast<int>(std::max<int64_t>(0, t - g.w - blk.k0));
  const int hi = static_cast<int>(std::min<int64_t>(blk.keys, t + (g.causal ? 0 : g.w) + 1 - blk.k0));
  return {lo, hi, static_cast<int>(blk.k0 + lo - t + g.w)};
}

// The buffers of one query chunk (2D) or block (1D): queries, keys and values of its window (local keys, then
// the global ones), scores.
template <typename T>
struct Workspace {
  std::vector<T> queries, keys, values, scores, extra, row_max, total;
  std::vector<T> key_mask;  // 1D: 0, or -inf at a padded key of the span
  int ld = 0;  // score row length, local keys + G

  Workspace(int64_t S, int64_t L, int64_t D)
      : queries(S * D), keys(L * D), values(L * D), scores(S * L), extra(std::max(S * L, L * D)), row_max(S),
        total(S), key_mask(L) {}
  explicit Workspace(const Geometry& g) : Workspace(g.w * g.w, kMaxSlots * g.w * g.w + g.G, g.D) {}
  explicit Workspace(const Geometry1d& g) : Workspace(g.block, g.span() + g.G, g.D) {}

  // Fills queries (times query_scale), keys and values of chunk c of the maps of one (batch, head).
  template <typename S>
  void load(const Geometry& g, const Chunk& c, Map<const S> q, Map<const S> k, Map<const S> v, const T* gk,
            const T* gv, T query_scale) {
    gather(queries.data(), q, c.q_r0, c.q_c0, c.q_rows, c.q_cols, g.D, query_scale);
    for (int s = 0; s < c.slots; ++s) {
      gather(keys.data() + c.start[s] * g.D, k, c.k_r0[s], c.k_c0[s], c.k_rows[s], c.k_cols[s], g.D, T(1));
      gather(values.data() + c.start[s] * g.D, v, c.k_r0[s], c.k_c0[s], c.k_rows[s], c.k_cols[s], g.D, T(1));
    }
    load_global(c.keys, gk, gv, g.G, g.D);
  }

  // Fills queries (times query_scale), keys and values of a block of one residue class of one (batch, head).
  template <typename S>
  void load(const Geometry1d& g, const Block& blk, Map<const S> q, Map<const S> k, Map<const S> v, const T* gk,
            const T* gv, T query_scale) {
    gather(queries.data(), q, blk.t0, 0, blk.queries, 1, g.D, query_scale);
    gather(keys.data(), k, blk.k0, 0, blk.keys, 1, g.D, T(1));
    gather(values.data(), v, blk.k0, 0, blk.keys, 1, g.D, T(1));
    load_global(blk.keys, gk, gv, g.G, g.D);
  }

  // scores = queries keys^T, with the biases added and -inf where a query does not see a key.
  void score(const Geometry& g, const Chunk& c, const T* rel_bias, const T* global_bias) {
    const int S = c.queries();
    matmul<T>(false, true, S, ld, g.D, T(1), queries.data(), g.D, keys.data(), g.D, T(0), scores.data(), ld);
    const T masked = -std::numeric_limits<T>::infinity();
    for (int i = 0; i < S; ++i) {
      T* row = scores.data() + static_cast<int64_t>(i) * ld;
      int next = 0;
      for_each_visible_run(g, c, i / c.q_cols, i % c.q_cols, [&](int first, int length, int bias_row) {
        std::fill(row + next, row + first, masked);
        if (rel_bias != nullptr) {
          for (int j = 0; j < length; ++j) row[first + j] += rel_bias[bias_row - j];
        }
        next = first + length;
      });
      std::fill(row + next, row + c.keys, masked);
      add_global_bias(row, c.keys, global_bias, g.G);
    }
  }

  // scores = queries keys^T, with the biases added and -inf outside each query's band, after the query when
  // causal, and at padded keys (key_padding: the batch entry's mask, or null).
  void score(const Geometry1d& g, const Block& blk, const T* rel_bias, const T* global_bias, const bool* key_padding) {
    matmul<T>(false, true, blk.queries, ld, g.D, T(1), queries.data(), g.D, keys.data(), g.D, T(0), scores.data(),
              ld);
    const T masked = -std::numeric_limits<T>::infinity();
    if (key_padding != nullptr) {
      for (int j = 0; j < blk.keys; ++j) key_mask[j] = key_padding[blk.r + blk.d * (blk.k0 + j)] ? masked : T(0);
    }
    for (int i = 0; i < blk.queries; ++i) {
      T* row = scores.data() + static_cast<int64_t>(i) * ld;
      const Band band = band_of(g, blk, i);
      std::fill(row, row + band.lo, masked);
      std::fill(row + band.hi, row + blk.keys, masked);
      if (rel_bias != nullptr) {
        const T* bias = rel_bias + band.bias_row - band.lo;
        for (int j = band.lo; j < band.hi; ++j) row[j] += bias[j];
      }
      if (key_padding != nullptr) {
        for (int j = band.lo; j < band.hi; ++j) row[j] += key_mask[j];
      }
      add_global_bias(row, blk.keys, global_bias, g.G);
    }
  }

  // The softmax numerators of the S score rows (their maxima and sums in row_max and total) times the values:
  // the unnormalised outputs, S x D in `extra`.
  const T* attend(int S, int64_t D) {
    for (int i = 0; i < S; ++i) exponentiate_row(scores.data() + static_cast<int64_t>(i) * ld, ld, row_max[i], total[i]);
    matmul<T>(false, false, S, D, ld, T(1), scores.data(), ld, values.data(), D, T(0), extra.data(), D);
    return extra.data();
  }

  // The backward of the softmax of the S score rows: the probabilities 2^(s - lse) in place of the scores, and
  // the score gradients dS = P * (dP - delta), dP = dO V^T, in grad_scores; delta = rowsum(dO * O).
  void differentiate(int S, int64_t D, const T* grad_out, const T* lse, const T* delta, T* grad_scores) {
    matmul<T>(false, true, S, ld, D, T(1), grad_out, D, values.data(), D, T(0), grad_scores, ld);
    for (int i = 0; i < S; ++i) {
      T* p = scores.data() + static_cast<int64_t>(i) * ld;
      T* ds = grad_scores + static_cast<int64_t>(i) * ld;
      const T row_lse = lse[i], row_delta = delta[i];
#pragma omp simd
      for (int j = 0; j < ld; ++j) {
        p[j] = exp2_nonpositive(p[j] - row_lse);
        ds[j] = p[j] * (ds[j] - row_delta);
      }
    }
  }

  // After differentiate: the gradients of the S queries (scale dS K, S x D), of the window's keys (scale dS^T q,
  // as the buffer holds q * scale * log2(e); ld x D) or of its values (P^T dO, ld x D), in `extra`.
  const T* grad_queries(int S, int64_t D, const T* grad_scores, double scale) {
    matmul<T>(false, false, S, D, ld, T(scale), grad_scores, ld, keys.data(), D, T(0), extra.data(), D);
    return extra.data();
  }
  const T* grad_keys(int S, int64_t D, const T* grad_scores) {
    matmul<T>(true, false, ld, D, S, T(1 / kLog2e), grad_scores, ld, queries.data(), D, T(0), extra.data(), D);
    return extra.data();
  }
  const T* grad_values(int S, int64_t D, const T* grad_out) {
    matmul<T>(true, false, ld, D, S, T(1), scores.data(), ld, grad_out, D, T(0), extra.data(), D);
    return extra.data();
  }

 private:
  // The G global keys and values after the window's `local` ones.
  void load_global(int local, const T* gk, const T* gv, int64_t G, int64_t D) {
    std::copy(gk, gk + G * D, keys.begin() + local * D);
    std::copy(gv, gv + G * D, values.begin() + local * D);
    ld = local + static_cast<int>(G);
  }

  static void add_global_bias(T* row, int local, const T* global_bias, int64_t G) {
    if (global_bias == nullptr) return;
    for (int64_t j = 0; j < G; ++j) row[local + j] += global_bias[j];
  }
};

template <typename T>
const T* head_of(const at::Tensor& t, int64_t bh, int64_t per_head) {
  return t.numel() == 0 ? nullptr : t.data_ptr<T>() + bh * per_head;
}

template <typename T>
T* grad_of(at::Tensor& t, int64_t bh, int64_t per_head) {
  return t.numel() == 0 ? nullptr : t.data_ptr<T>() + bh * per_head;
}

// The softmax backward's row terms delta = rowsum(dO * O) of n queries: dO (n x D, contiguous) and the block of
// the output `out` from token (r0, c0), rows x cols tokens.
template <typename S, typename T>
void row_terms(T* delta, const T* grad_out, Map<const S> out, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
               int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const S* o = out.at(r0 + r, c0 + c);
      const T* dout = grad_out + (r * cols + c) * D;
      T sum = 0;
      for (int64_t d = 0; d < D; ++d) sum += dout[d] * widen<T>(o[d]);
      delta[r * cols + c] = sum;
    }
  }
}

template <typename S, typename T>
void forward_impl(const Geometry& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& rel_bias,
                  const at::Tensor& global_bias, const int64_t* slot_table, at::Tensor& out, at::Tensor& lse,
                  double scale) {
  const int64_t C = g.chunks(), table = (4 * g.w - 1) * (4 * g.w - 1);
  at::parallel_for(0, g.B * g.H * C, 1, [&](int64_t begin, int64_t end) {
    Workspace<T> ws(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / C, b = bh / g.H, h = bh % g.H;
      const Chunk c = make_chunk(g, slot_table, item % C);
      ws.load(g, c, map_of<const S>(q, b, h), map_of<const S>(k, b, h), map_of<const S>(v, b, h),
              head_of<T>(gk, bh, g.G * g.D), head_of<T>(gv, bh, g.G * g.D), T(scale * kLog2e));
      ws.score(g, c, head_of<T>(rel_bias, h, table), head_of<T>(global_bias, h, g.G));
      const T* o = ws.attend(c.queries(), g.D);
      const Map<S> out_map = map_of<S>(out, b, h);
      T* lse_map = lse.data_ptr<T>() + bh * g.X * g.Y;
      for (int i = 0; i < c.queries(); ++i) {
        const int64_t row = c.q_r0 + i / c.q_cols, col = c.q_c0 + i % c.q_cols;
        store_output(out_map.at(row, col), lse_map + row * g.Y + col, o + i * g.D, g.D, ws.row_max[i],
                     ws.total[i]);
      }
    }
  });
}

template <typename S, typename T>
void backward_impl(const Geometry& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& rel_bias,
                   const at::Tensor& global_bias, const int64_t* slot_table, const at::Tensor& out,
                   const at::Tensor& grad_out, const at::Tensor& lse, at::Tensor& grad_q, at::Tensor& grad_k,
                   at::Tensor& grad_v, at::Tensor& grad_gk, at::Tensor& grad_gv, at::Tensor& grad_rel_bias,
                   at::Tensor& grad_global_bias, double scale) {
  const int64_t C = g.chunks(), table = (4 * g.w - 1) * (4 * g.w - 1), S_max = g.w * g.w;
  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
    Workspace<T> ws(g);
    std::vector<T> grad_out_chunk(S_max * g.D), grad_scores(ws.scores.size()), lse_rows(S_max), delta_rows(S_max);
    GradientSum<S, T> sum_k, sum_v;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.H, h = bh % g.H;
      const Map<const S> q_map = map_of<const S>(q, b, h), k_map = map_of<const S>(k, b, h),
                         v_map = map_of<const S>(v, b, h), out_map = map_of<const S>(out, b, h),
                         grad_out_map = map_of<const S>(grad_out, b, h);
      const T* rel = head_of<T>(rel_bias, h, table);
      T* grad_rel = grad_of<T>(grad_rel_bias, bh, table);
      T* grad_glob = grad_of<T>(grad_global_bias, bh, g.G);
      const T* lse_map = lse.data_ptr<T>() + bh * g.X * g.Y;
      sum_k.start(map_of<S>(grad_k, b, h), g.X, g.Y, g.D);
      sum_v.start(map_of<S>(grad_v, b, h), g.X, g.Y, g.D);
      for (int64_t chunk = 0; chunk < C; ++chunk) {
        const Chunk c = make_chunk(g, slot_table, chunk);
        const int n = c.queries();
        ws.load(g, c, q_map, k_map, v_map, head_of<T>(gk, bh, g.G * g.D), head_of<T>(gv, bh, g.G * g.D),
                T(scale * kLog2e));
        ws.score(g, c, rel, head_of<T>(global_bias, h, g.G));
        gather(grad_out_chunk.data(), grad_out_map, c.q_r0, c.q_c0, c.q_rows, c.q_cols, g.D, T(1));
        row_terms(delta_rows.data(), grad_out_chunk.data(), out_map, c.q_r0, c.q_c0, c.q_rows, c.q_cols, g.D);
        for (int i = 0; i < n; ++i) lse_rows[i] = lse_map[(c.q_r0 + i / c.q_cols) * g.Y + c.q_c0 + i % c.q_cols];
        T* ds = grad_scores.data();
        ws.differentiate(n, g.D, grad_out_chunk.data(), lse_rows.data(), delta_rows.data(), ds);
        for (int i = 0; i < n; ++i) {
          const T* row = ds + static_cast<int64_t>(i) * ws.ld;
          if (grad_rel != nullptr) {
            for_each_visible_run(g, c, i / c.q_cols, i % c.q_cols, [&](int first, int length, int bias_row) {
              for (int j = 0; j < length; ++j) grad_rel[bias_row - j] += row[first + j];
            });
          }
          if (grad_glob != nullptr) add_into(grad_glob, row + c.keys, g.G);
        }
        // Written in place: every query belongs to one chunk.
        scatter(map_of<S>(grad_q, b, h), c.q_r0, c.q_c0, c.q_rows, c.q_cols, g.D, ws.grad_queries(n, g.D, ds, scale),
                false);
        // Gradients of the chunk's keys (or values), (L + G) x D, into the maps and the global ones.
        auto add_window = [&](const T* block, const GradientSum<S, T>& sum, at::Tensor& grad_global) {
          for (int s = 0; s < c.slots; ++s) {
            scatter(sum.target, c.k_r0[s], c.k_c0[s], c.k_rows[s], c.k_cols[s], g.D, block + c.start[s] * g.D, true);
          }
          add_into(grad_global.data_ptr<T>() + bh * g.G * g.D, block + c.keys * g.D, g.G * g.D);
        };
        add_window(ws.grad_keys(n, g.D, ds), sum_k, grad_gk);
        add_window(ws.grad_values(n, g.D, grad_out_chunk.data()), sum_v, grad_gv);
      }
      sum_k.finish();
      sum_v.finish();
    }
  });
}

template <typename S, typename T>
void forward_1d_impl(const Geometry1d& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& rel_bias,
                     const at::Tensor& global_bias, const at::Tensor& key_padding_mask, at::Tensor& out,
                     at::Tensor& lse, double scale) {
  std::vector<int64_t> runs;
  const std::vector<Block> blocks = make_blocks(g, runs);
  const int64_t n = static_cast<int64_t>(blocks.size()), bias_rows = 2 * g.w + 1;
  at::parallel_for(0, g.B * n, 1, [&](int64_t begin, int64_t end) {
    Workspace<T> ws(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n;
      const Block& blk = blocks[item % n];
      const int64_t bh = b * g.H + blk.h;
      ws.load(g, blk, map_of<const S>(q, b, blk.h).every(blk.r, blk.d),
              map_of<const S>(k, b, blk.h).every(blk.r, blk.d), map_of<const S>(v, b, blk.h).every(blk.r, blk.d),
              head_of<T>(gk, bh, g.G * g.D), head_of<T>(gv, bh, g.G * g.D), T(scale * kLog2e));
      ws.score(g, blk, head_of<T>(rel_bias, blk.h, bias_rows), head_of<T>(global_bias, blk.h, g.G),
               head_of<bool>(key_padding_mask, b, g.L));
      const T* o = ws.attend(blk.queries, g.D);
      const Map<S> out_class = map_of<S>(out, b, blk.h).every(blk.r, blk.d);
      T* lse_seq = lse.data_ptr<T>() + bh * g.L;
      for (int i = 0; i < blk.queries; ++i) {
        const int64_t t = blk.t0 + i;
        store_output(out_class.at(t, 0), lse_seq + blk.r + blk.d * t, o + i * g.D, g.D, ws.row_max[i], ws.total[i]);
      }
    }
  });
}

// The global key, value and bias gradients are partial sums per (batch, head, residue class), added up by the
// caller, so that the residue classes of one head can run on different threads.
template <typename S, typename T>
void backward_1d_impl(const Geometry1d& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& rel_bias,
                      const at::Tensor& global_bias, const at::Tensor& key_padding_mask, const at::Tensor& out,
                      const at::Tensor& grad_out, const at::Tensor& lse, at::Tensor& grad_q, at::Tensor& grad_k,
                      at::Tensor& grad_v, at::Tensor& grad_gk, at::Tensor& grad_gv, at::Tensor& grad_rel_bias,
                      at::Tensor& grad_global_bias, double scale) {
  std::vector<int64_t> runs;
  const std::vector<Block> blocks = make_blocks(g, runs);
  const int64_t classes = static_cast<int64_t>(runs.size()) - 1, bias_rows = 2 * g.w + 1;
  at::parallel_for(0, g.B * classes, 1, [&](int64_t begin, int64_t end) {
    Workspace<T> ws(g);
    std::vector<T> grad_out_block(g.block * g.D), grad_scores(ws.scores.size()), lse_rows(g.block),
        delta_rows(g.block);
    GradientSum<S, T> sum_k, sum_v;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / classes, run = item % classes;
      const Block& first = blocks[runs[run]];
      const int64_t h = first.h, r = first.r, d = first.d, bh = b * g.H + h, partial = bh * g.residues + r;
      const Map<const S> q_class = map_of<const S>(q, b, h).every(r, d), k_class = map_of<const S>(k, b, h).every(r, d),
                         v_class = map_of<const S>(v, b, h).every(r, d),
                         out_class = map_of<const S>(out, b, h).every(r, d),
                         grad_out_class = map_of<const S>(grad_out, b, h).every(r, d);
      const T* rel = head_of<T>(rel_bias, h, bias_rows);
      const T* glob = head_of<T>(global_bias, h, g.G);
      const T* lse_seq = lse.data_ptr<T>() + bh * g.L;
      const bool* key_padding = head_of<bool>(key_padding_mask, b, g.L);
      T* grad_rel = grad_of<T>(grad_rel_bias, partial, bias_rows);
      T* grad_glob = grad_of<T>(grad_global_bias, partial, g.G);
      const int64_t length = (g.L - r + d - 1) / d;  // of the residue class
      sum_k.start(map_of<S>(grad_k, b, h).every(r, d), length, 1, g.D);
      sum_v.start(map_of<S>(grad_v, b, h).every(r, d), length, 1, g.D);
      for (int64_t index = runs[run]; index < runs[run + 1]; ++index) {
        const Block& blk = blocks[index];
        const int n = blk.queries;
        ws.load(g, blk, q_class, k_class, v_class, head_of<T>(gk, bh, g.G * g.D), head_of<T>(gv, bh, g.G * g.D),
                T(scale * kLog2e));
        ws.score(g, blk, rel, glob, key_padding);
        gather(grad_out_block.data(), grad_out_class, blk.t0, 0, n, 1, g.D, T(1));
        row_terms(delta_rows.data(), grad_out_block.data(), out_class, blk.t0, 0, n, 1, g.D);
        for (int i = 0; i < n; ++i) lse_rows[i] = lse_seq[r + d * (blk.t0 + i)];
        T* ds = grad_scores.data();
        ws.differentiate(n, g.D, grad_out_block.data(), lse_rows.data(), delta_rows.data(), ds);
        for (int i = 0; i < n; ++i) {
          const T* row = ds + static_cast<int64_t>(i) * ws.ld;
          if (grad_rel != nullptr) {
            const Band band = band_of(g, blk, i);
            T* bias = grad_rel + band.bias_row - band.lo;
            for (int j = band.lo; j < band.hi; ++j) bias[j] += row[j];
          }
          if (grad_glob != nullptr) add_into(grad_glob, row + blk.keys, g.G);
        }
        // Written in place: every query belongs to one block.
        scatter(map_of<S>(grad_q, b, h).every(r, d), blk.t0, 0, n, 1, g.D, ws.grad_queries(n, g.D, ds, scale), false);
        // Gradients of the span's keys (or values), (keys + G) x D, into the sequence and the global partial sums.
        auto add_window = [&](const T* block, const GradientSum<S, T>& sum, at::Tensor& grad_global) {
          scatter(sum.target, blk.k0, 0, blk.keys, 1, g.D, block, true);
          add_into(grad_global.data_ptr<T>() + partial * g.G * g.D, block + blk.keys * g.D, g.G * g.D);
        };
        add_window(ws.grad_keys(n, g.D, ds), sum_k, grad_gk);
        add_window(ws.grad_values(n, g.D, grad_out_block.data()), sum_v, grad_gv);
      }
      sum_k.finish();
      sum_v.finish();
    }
  });
}

// The elements of each token contiguous, the other dimensions as they come: what the kernels read and write.
void check_tokens(std::initializer_list<const at::Tensor*> tensors, int64_t dims, at::ScalarType dtype) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->dim() == dims && (t->size(-1) <= 1 || t->stride(-1) == 1) && t->scalar_type() == dtype,
                "local_attention_cpu: inputs not laid out by the launcher");
  }
}

// The compute type's tensors (global keys and values, bias tables, log-sum-exp) are contiguous.
void check_compute(std::initializer_list<const at::Tensor*> tensors, at::ScalarType compute) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->numel() == 0 || (t->is_contiguous() && t->scalar_type() == compute),
                "local_attention_cpu: inputs not laid out by the launcher");
  }
}

at::ScalarType compute_type(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

Geometry make_geometry(const at::Tensor& q, const at::Tensor& gk, const at::Tensor& slots, int64_t window,
                       int64_t exact) {
  TORCH_CHECK(q.dim() == 5 && slots.dim() == 3 && slots.is_contiguous() && slots.size(1) <= kMaxSlots,
              "local_attention_cpu: inputs not laid out by the launcher");
  Geometry g;
  g.B = q.size(0), g.H = q.size(1), g.X = q.size(2), g.Y = q.size(3), g.D = q.size(4), g.G = gk.size(2);
  g.w = static_cast<int>(window), g.exact = static_cast<int>(exact);
  g.chunk_cols = static_cast<int>((g.Y + g.w - 1) / g.w);
  g.num_slots = static_cast<int>(slots.size(1));
  return g;
}

Geometry1d make_geometry_1d(const at::Tensor& q, const at::Tensor& gk, const at::Tensor& key_padding_mask,
                            at::IntArrayRef dilations, int64_t window, bool causal, int64_t block) {
  TORCH_CHECK(q.dim() == 4 && static_cast<int64_t>(dilations.size()) == q.size(1) && block >= 1 &&
                  (key_padding_mask.numel() == 0 ||
                   (key_padding_mask.scalar_type() == at::kBool && key_padding_mask.is_contiguous())),
              "local_attention_cpu: inputs not laid out by the launcher");
  Geometry1d g;
  g.B = q.size(0), g.H = q.size(1), g.L = q.size(2), g.D = q.size(3), g.G = gk.size(2);
  g.w = static_cast<int>(window), g.block = static_cast<int>(block), g.causal = causal;
  g.dilations.assign(dilations.begin(), dilations.end());
  g.residues = 0;
  for (const int64_t d : g.dilations) g.residues = std::max(g.residues, std::min(d, g.L));
  return g;
}

// Calls fn with a value of the storage type of q and one of its compute type.
template <typename F>
void dispatch(const at::Tensor& q, F&& fn) {
  switch (q.scalar_type()) {
    case at::kFloat: return fn(float{}, float{});
    case at::kDouble: return fn(double{}, double{});
    case at::kBFloat16: return fn(c10::BFloat16{}, float{});
    case at::kHalf: return fn(c10::Half{}, float{});
    default: TORCH_CHECK(false, "local_attention_cpu: inputs not laid out by the launcher");
  }
}

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
             const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
             const at::Tensor& slots, at::Tensor out, at::Tensor lse, int64_t window, int64_t exact, double scale) {
  const Geometry g = make_geometry(q, gk, slots, window, exact);
  check_tokens({&q, &k, &v, &out}, 5, q.scalar_type());
  check_compute({&gk, &gv, &rel_bias, &global_bias, &lse}, compute_type(q));
  dispatch(q, [&](auto s, auto t) {
    using S = decltype(s);
    using T = decltype(t);
    forward_impl<S, T>(g, q, k, v, gk, gv, rel_bias, global_bias, slots.data_ptr<int64_t>(), out, lse, scale);
  });
}

void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
              const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
              const at::Tensor& slots, const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& lse,
              at::Tensor grad_q, at::Tensor grad_k, at::Tensor grad_v, at::Tensor grad_gk, at::Tensor grad_gv,
              at::Tensor grad_rel_bias, at::Tensor grad_global_bias, int64_t window, int64_t exact, double scale) {
  const Geometry g = make_geometry(q, gk, slots, window, exact);
  check_tokens({&q, &k, &v, &out, &grad_out, &grad_q, &grad_k, &grad_v}, 5, q.scalar_type());
  check_compute({&gk, &gv, &rel_bias, &global_bias, &lse, &grad_gk, &grad_gv, &grad_rel_bias, &grad_global_bias},
                compute_type(q));
  dispatch(q, [&](auto s, auto t) {
    using S = decltype(s);
    using T = decltype(t);
    backward_impl<S, T>(g, q, k, v, gk, gv, rel_bias, global_bias, slots.data_ptr<int64_t>(), out, grad_out, lse,
                        grad_q, grad_k, grad_v, grad_gk, grad_gv, grad_rel_bias, grad_global_bias, scale);
  });
}

void forward_1d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
                const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
                const at::Tensor& key_padding_mask, at::Tensor out, at::Tensor lse, at::IntArrayRef dilations,
                int64_t window, bool causal, int64_t block, double scale) {
  const Geometry1d g = make_geometry_1d(q, gk, key_padding_mask, dilations, window, causal, block);
  check_tokens({&q, &k, &v, &out}, 4, q.scalar_type());
  check_compute({&gk, &gv, &rel_bias, &global_bias, &lse}, compute_type(q));
  dispatch(q, [&](auto s, auto t) {
    using S = decltype(s);
    using T = decltype(t);
    forward_1d_impl<S, T>(g, q, k, v, gk, gv, rel_bias, global_bias, key_padding_mask, out, lse, scale);
  });
}

void backward_1d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
                 const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
                 const at::Tensor& key_padding_mask, const at::Tensor& out, const at::Tensor& grad_out,
                 const at::Tensor& lse, at::Tensor grad_q, at::Tensor grad_k, at::Tensor grad_v, at::Tensor grad_gk,
                 at::Tensor grad_gv, at::Tensor grad_rel_bias, at::Tensor grad_global_bias,
                 at::IntArrayRef dilations, int64_t window, bool causal, int64_t block, double scale) {
  const Geometry1d g = make_geometry_1d(q, gk, key_padding_mask, dilations, window, causal, block);
  check_tokens({&q, &k, &v, &out, &grad_out, &grad_q, &grad_k, &grad_v}, 4, q.scalar_type());
  check_compute({&gk, &gv, &rel_bias, &global_bias, &lse, &grad_gk, &grad_gv, &grad_rel_bias, &grad_global_bias},
                compute_type(q));
  dispatch(q, [&](auto s, auto t) {
    using S = decltype(s);
    using T = decltype(t);
    backward_1d_impl<S, T>(g, q, k, v, gk, gv, rel_bias, global_bias, key_padding_mask, out, grad_out, lse, grad_q,
                           grad_k, grad_v, grad_gk, grad_gv, grad_rel_bias, grad_global_bias, scale);
  });
}

}  // namespace

TORCH_LIBRARY(vil_local_attention_cpu, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, Tensor global_bias, "
      "Tensor slots, Tensor(a!) out, Tensor(b!) lse, int window, int exact, float scale) -> ()");
  m.def(
      "backward(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, "
      "Tensor global_bias, Tensor slots, Tensor out, Tensor grad_out, Tensor lse, Tensor(a!) grad_q, "
      "Tensor(b!) grad_k, Tensor(c!) grad_v, Tensor(d!) grad_global_k, Tensor(e!) grad_global_v, "
      "Tensor(f!) grad_rel_bias, Tensor(g!) grad_global_bias, int window, int exact, float scale) -> ()");
  m.def(
      "forward_1d(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, "
      "Tensor global_bias, Tensor key_padding_mask, Tensor(a!) out, Tensor(b!) lse, int[] dilations, int window, "
      "bool causal, int block, float scale) -> ()");
  m.def(
      "backward_1d(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, "
      "Tensor global_bias, Tensor key_padding_mask, Tensor out, Tensor grad_out, Tensor lse, "
      "Tensor(a!) grad_q, Tensor(b!) grad_k, Tensor(c!) grad_v, Tensor(d!) grad_global_k, "
      "Tensor(e!) grad_global_v, Tensor(f!) grad_rel_bias, Tensor(g!) grad_global_bias, int[] dilations, "
      "int window, bool causal, int block, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vil_local_attention_cpu, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
  m.impl("forward_1d", &forward_1d);
  m.impl("backward_1d", &backward_1d);
}
