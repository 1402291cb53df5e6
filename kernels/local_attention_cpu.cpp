// Fused 2D local attention (ViL's conv-like windows) on the CPU.
//
// One query chunk (w x w queries) of one (batch, head) at a time: its keys, the blocks of the chunks its
// queries see (the "slots"), and the G global keys are copied into small buffers, and the whole softmax of
// the chunk runs on an S x (L + G) score matrix that stays in the core's cache. The matrix products are BLAS
// calls on those buffers (sgemm_/dgemm_, which torch's CPU library exports); the masking, the bias tables
// and the softmax are loops over one score row at a time.
//
// Forward: saves the output and the base-2 log-sum-exp of every query; chunks run in parallel.
// Backward: recomputes the probabilities from the log-sum-exp; the chunks of one (batch, head) run in
// order on one thread, so that the key, value and bias gradients they share are added without races.
//
// Scores are in base 2 (queries times scale * log2(e), biases times log2(e) by the caller), so that the
// softmax needs exp2 only. Tensors are contiguous: q, k, v, out (B, H, X, Y, D); lse (B, H, X, Y);
// global_k, global_v (B, H, G, D); rel_bias (H, (4w-1)^2) or empty; global_bias (H, G) or empty; slots
// (C, n, 3) int64: for each chunk (row-major) and neighbour slot, the chunk it reads (-1: none) and the
// slot's chunk offset (a, b), which the relative bias uses as if neighbour chunks were adjacent.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// Copies rows x cols tokens at (r0, c0) of one (X, Y, D) map into dst, times factor.
template <typename T>
void copy_block(T* dst, const T* map, const Geometry& g, int r0, int c0, int rows, int cols, T factor) {
  const int64_t n = static_cast<int64_t>(cols) * g.D;
  for (int r = 0; r < rows; ++r) {
    const T* src = map + ((r0 + r) * g.Y + c0) * g.D;
    T* out = dst + r * n;
    for (int64_t i = 0; i < n; ++i) out[i] = src[i] * factor;
  }
}

// Adds rows x cols tokens of src into the block at (r0, c0) of one (X, Y, D) map.
template <typename T>
void add_block(T* map, const T* src, const Geometry& g, int r0, int c0, int rows, int cols) {
  const int64_t n = static_cast<int64_t>(cols) * g.D;
  for (int r = 0; r < rows; ++r) {
    T* dst = map + ((r0 + r) * g.Y + c0) * g.D;
    const T* in = src + r * n;
    for (int64_t i = 0; i < n; ++i) dst[i] += in[i];
  }
}

// The buffers of one chunk: queries, keys and values of its window (local keys, then the global ones), scores.
template <typename T>
struct Workspace {
  std::vector<T> queries, keys, values, scores, extra, row_max, total;
  int ld = 0;  // score row length, L + G

  Workspace(const Geometry& g) {
    const int64_t S = g.w * g.w, L = kMaxSlots * S + g.G;
    queries.resize(S * g.D);
    keys.resize(L * g.D);
    values.resize(L * g.D);
    scores.resize(S * L);
    extra.resize(std::max(S * L, L * g.D));
    row_max.resize(S);
    total.resize(S);
  }

  // Fills queries (times query_scale), keys and values of chunk c of the maps of one (batch, head).
  void load(const Geometry& g, const Chunk& c, const T* q, const T* k, const T* v, const T* gk, const T* gv,
            T query_scale) {
    copy_block(queries.data(), q, g, c.q_r0, c.q_c0, c.q_rows, c.q_cols, query_scale);
    for (int s = 0; s < c.slots; ++s) {
      copy_block(keys.data() + c.start[s] * g.D, k, g, c.k_r0[s], c.k_c0[s], c.k_rows[s], c.k_cols[s], T(1));
      copy_block(values.data() + c.start[s] * g.D, v, g, c.k_r0[s], c.k_c0[s], c.k_rows[s], c.k_cols[s], T(1));
    }
    std::copy(gk, gk + g.G * g.D, keys.begin() + c.keys * g.D);
    std::copy(gv, gv + g.G * g.D, values.begin() + c.keys * g.D);
    ld = c.keys + g.G;
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
      if (global_bias != nullptr) {
        for (int j = 0; j < g.G; ++j) row[c.keys + j] += global_bias[j];
      }
    }
  }
};

template <typename T>
const T* head_of(const at::Tensor& t, int64_t bh, int64_t per_head) {
  return t.numel() == 0 ? nullptr : t.data_ptr<T>() + bh * per_head;
}

template <typename T>
void forward_impl(const Geometry& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& rel_bias,
                  const at::Tensor& global_bias, const int64_t* slot_table, at::Tensor& out, at::Tensor& lse,
                  double scale) {
  const int64_t map = g.X * g.Y * g.D, C = g.chunks(), table = (4 * g.w - 1) * (4 * g.w - 1);
  at::parallel_for(0, g.B * g.H * C, 1, [&](int64_t begin, int64_t end) {
    Workspace<T> ws(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / C, h = bh % g.H;
      const Chunk c = make_chunk(g, slot_table, item % C);
      ws.load(g, c, head_of<T>(q, bh, map), head_of<T>(k, bh, map), head_of<T>(v, bh, map),
              head_of<T>(gk, bh, g.G * g.D), head_of<T>(gv, bh, g.G * g.D), T(scale * kLog2e));
      ws.score(g, c, head_of<T>(rel_bias, h, table), head_of<T>(global_bias, h, g.G));
      const int S = c.queries();
      T* row_max = ws.row_max.data();
      T* total = ws.total.data();
      for (int i = 0; i < S; ++i) {
        T* row = ws.scores.data() + static_cast<int64_t>(i) * ws.ld;
        T m = row[0], sum = 0;
#pragma omp simd reduction(max : m)
        for (int j = 0; j < ws.ld; ++j) m = m > row[j] ? m : row[j];  // std::max does not vectorise
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < ws.ld; ++j) {
          row[j] = exp2_nonpositive(row[j] - m);
          sum += row[j];
        }
        row_max[i] = m;
        total[i] = sum;
      }
      T* o = ws.extra.data();
      matmul<T>(false, false, S, g.D, ws.ld, T(1), ws.scores.data(), ws.ld, ws.values.data(), g.D, T(0), o, g.D);
      T* out_map = out.data_ptr<T>() + bh * map;
      T* lse_map = lse.data_ptr<T>() + bh * g.X * g.Y;
      for (int i = 0; i < S; ++i) {
        const int64_t token = (c.q_r0 + i / c.q_cols) * g.Y + c.q_c0 + i % c.q_cols;
        const T inverse = T(1) / total[i];
        for (int d = 0; d < g.D; ++d) out_map[token * g.D + d] = o[i * g.D + d] * inverse;
        lse_map[token] = row_max[i] + std::log2(total[i]);
      }
    }
  });
}

template <typename T>
void backward_impl(const Geometry& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& rel_bias,
                   const at::Tensor& global_bias, const int64_t* slot_table, const at::Tensor& grad_out,
                   const at::Tensor& lse, const at::Tensor& row_term, at::Tensor& grad_q, at::Tensor& grad_k,
                   at::Tensor& grad_v, at::Tensor& grad_gk, at::Tensor& grad_gv, at::Tensor& grad_rel_bias,
                   at::Tensor& grad_global_bias, double scale) {
  const int64_t map = g.X * g.Y * g.D, C = g.chunks(), table = (4 * g.w - 1) * (4 * g.w - 1);
  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
    Workspace<T> ws(g);
    std::vector<T> grad_out_chunk(g.w * g.w * g.D), grad_scores(ws.scores.size());
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t h = bh % g.H;
      const T* rel = head_of<T>(rel_bias, h, table);
      T* grad_rel = grad_rel_bias.numel() == 0 ? nullptr : grad_rel_bias.data_ptr<T>() + bh * table;
      T* grad_glob = grad_global_bias.numel() == 0 ? nullptr : grad_global_bias.data_ptr<T>() + bh * g.G;
      const T* lse_map = lse.data_ptr<T>() + bh * g.X * g.Y;
      const T* row_term_map = row_term.data_ptr<T>() + bh * g.X * g.Y;
      for (int64_t chunk = 0; chunk < C; ++chunk) {
        const Chunk c = make_chunk(g, slot_table, chunk);
        const int S = c.queries(), ld = c.keys + g.G;
        ws.load(g, c, head_of<T>(q, bh, map), head_of<T>(k, bh, map), head_of<T>(v, bh, map),
                head_of<T>(gk, bh, g.G * g.D), head_of<T>(gv, bh, g.G * g.D), T(scale * kLog2e));
        ws.score(g, c, rel, head_of<T>(global_bias, h, g.G));
        copy_block(grad_out_chunk.data(), head_of<T>(grad_out, bh, map), g, c.q_r0, c.q_c0, c.q_rows, c.q_cols,
                   T(1));
        T* probs = ws.scores.data();
        T* dp = grad_scores.data();
        matmul<T>(false, true, S, ld, g.D, T(1), grad_out_chunk.data(), g.D, ws.values.data(), g.D, T(0), dp, ld);
        for (int i = 0; i < S; ++i) {
          const int64_t token = (c.q_r0 + i / c.q_cols) * g.Y + c.q_c0 + i % c.q_cols;
          const T row_lse = lse_map[token], delta = row_term_map[token];
          T* p = probs + static_cast<int64_t>(i) * ld;
          T* ds = dp + static_cast<int64_t>(i) * ld;
#pragma omp simd
          for (int j = 0; j < ld; ++j) {
            p[j] = exp2_nonpositive(p[j] - row_lse);
            ds[j] = p[j] * (ds[j] - delta);  // the softmax backward: dS = P * (dP - rowsum(dO * O))
          }
          if (grad_rel != nullptr) {
            for_each_visible_run(g, c, i / c.q_cols, i % c.q_cols, [&](int first, int length, int bias_row) {
              for (int j = 0; j < length; ++j) grad_rel[bias_row - j] += ds[first + j];
            });
          }
          if (grad_glob != nullptr) {
            for (int j = 0; j < g.G; ++j) grad_glob[j] += ds[c.keys + j];
          }
        }
        // dQ = scale * dS K, written in place: every query belongs to one chunk.
        T* block = ws.extra.data();
        matmul<T>(false, false, S, g.D, ld, T(scale), dp, ld, ws.keys.data(), g.D, T(0), block, g.D);
        T* grad_q_map = grad_q.data_ptr<T>() + bh * map;
        for (int r = 0; r < c.q_rows; ++r) {
          std::copy(block + r * c.q_cols * g.D, block + (r + 1) * c.q_cols * g.D,
                    grad_q_map + ((c.q_r0 + r) * g.Y + c.q_c0) * g.D);
        }
        // Gradients of the chunk's keys (or values), (L + G) x D in `block`, into the maps and the global ones.
        auto add_window = [&](at::Tensor& grad_map, at::Tensor& grad_global) {
          for (int s = 0; s < c.slots; ++s) {
            add_block(grad_map.data_ptr<T>() + bh * map, block + c.start[s] * g.D, g, c.k_r0[s], c.k_c0[s],
                      c.k_rows[s], c.k_cols[s]);
          }
          T* global = grad_global.data_ptr<T>() + bh * g.G * g.D;
          for (int64_t i = 0; i < g.G * g.D; ++i) global[i] += block[c.keys * g.D + i];
        };
        // dK = scale * dS^T q (the buffer holds q * scale * log2(e)), dV = P^T dO.
        matmul<T>(true, false, ld, g.D, S, T(1 / kLog2e), dp, ld, ws.queries.data(), g.D, T(0), block, g.D);
        add_window(grad_k, grad_gk);
        matmul<T>(true, false, ld, g.D, S, T(1), probs, ld, grad_out_chunk.data(), g.D, T(0), block, g.D);
        add_window(grad_v, grad_gv);
      }
    }
  });
}

Geometry make_geometry(const at::Tensor& q, const at::Tensor& gk, const at::Tensor& slots, int64_t window,
                       int64_t exact) {
  TORCH_CHECK(q.dim() == 5 && q.is_contiguous() && slots.dim() == 3 && slots.size(1) <= kMaxSlots,
              "local_attention_cpu: inputs not laid out by the launcher");
  Geometry g;
  g.B = q.size(0), g.H = q.size(1), g.X = q.size(2), g.Y = q.size(3), g.D = q.size(4), g.G = gk.size(2);
  g.w = static_cast<int>(window), g.exact = static_cast<int>(exact);
  g.chunk_cols = static_cast<int>((g.Y + g.w - 1) / g.w);
  g.num_slots = static_cast<int>(slots.size(1));
  return g;
}

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
             const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
             const at::Tensor& slots, at::Tensor out, at::Tensor lse, int64_t window, int64_t exact, double scale) {
  const Geometry g = make_geometry(q, gk, slots, window, exact);
  if (q.scalar_type() == at::kFloat) {
    forward_impl<float>(g, q, k, v, gk, gv, rel_bias, global_bias, slots.data_ptr<int64_t>(), out, lse, scale);
  } else {
    forward_impl<double>(g, q, k, v, gk, gv, rel_bias, global_bias, slots.data_ptr<int64_t>(), out, lse, scale);
  }
}

void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
              const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
              const at::Tensor& slots, const at::Tensor& grad_out, const at::Tensor& lse, const at::Tensor& row_term,
              at::Tensor grad_q, at::Tensor grad_k, at::Tensor grad_v, at::Tensor grad_gk, at::Tensor grad_gv,
              at::Tensor grad_rel_bias, at::Tensor grad_global_bias, int64_t window, int64_t exact, double scale) {
  const Geometry g = make_geometry(q, gk, slots, window, exact);
  const int64_t* table = slots.data_ptr<int64_t>();
  if (q.scalar_type() == at::kFloat) {
    backward_impl<float>(g, q, k, v, gk, gv, rel_bias, global_bias, table, grad_out, lse, row_term, grad_q, grad_k,
                         grad_v, grad_gk, grad_gv, grad_rel_bias, grad_global_bias, scale);
  } else {
    backward_impl<double>(g, q, k, v, gk, gv, rel_bias, global_bias, table, grad_out, lse, row_term, grad_q,
                          grad_k, grad_v, grad_gk, grad_gv, grad_rel_bias, grad_global_bias, scale);
  }
}

}  // namespace

TORCH_LIBRARY(vil_local_attention_cpu, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, Tensor global_bias, "
      "Tensor slots, Tensor(a!) out, Tensor(b!) lse, int window, int exact, float scale) -> ()");
  m.def(
      "backward(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, "
      "Tensor global_bias, Tensor slots, Tensor grad_out, Tensor lse, Tensor row_term, Tensor(a!) grad_q, "
      "Tensor(b!) grad_k, Tensor(c!) grad_v, Tensor(d!) grad_global_k, Tensor(e!) grad_global_v, "
      "Tensor(f!) grad_rel_bias, Tensor(g!) grad_global_bias, int window, int exact, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vil_local_attention_cpu, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
