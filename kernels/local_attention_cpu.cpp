// Fused local attention on the CPU: ViL's 2D windows and Longformer's 1D sliding window.
//
// 2D: one query chunk (w x w queries) of one (batch, head) at a time: its keys, the blocks of the chunks its
// queries see (the "slots"), and the G global keys are copied into small buffers (the half-precision products read
// the key blocks in place instead, from the map's keys written once per call chunk after chunk: MapLayouts), and the
// whole softmax of the chunk runs on an S x (L + G) score matrix that stays in the core's cache; the biases and masks
// are added from a dense table per kind of chunk (ChunkBiases), the softmax runs on score rows (two at a time in its
// vector form).
//
// 1D: the positions r, r+d, r+2d, ... of a head with dilation d (one residue class r) form a sequence of their
// own, on which the window is the undilated one. One block of consecutive queries of such a sequence at a
// time: the keys their windows cover are one span of that sequence (at most block + 2w keys, block + w
// causal, from an even position), read in place from the keys and values of its residue class, written once per
// call in the layouts the products read (ClassLayouts; their memory is kept for the next call, Scratch), and the G
// global keys; the band, the causal and padding masks and the bias table are applied row by row (without biases and
// padding, the scale is left to the softmax, which applies it as it reads each row).
//
// Forward: saves the output and the base-2 log-sum-exp of every query; chunks (blocks) run in parallel.
// Backward: recomputes the probabilities from the log-sum-exp; the chunks of one (batch, head), or the blocks
// of one residue class of one (batch, head), run in order on one thread, so that the key, value and bias
// gradients they share are added without races (in 1D, by the products themselves, into the class's sums).
//
// The matrix products, two ways (the caller chooses; the rest is the same code):
// - FloatProducts: in the compute type T (double for double, else float) with BLAS (sgemm_/dgemm_, which torch's
//   CPU library exports). q, k, v in the storage type S (float, double, bfloat16 or half) are converted to T as
//   the buffers are filled; queries are scaled then.
// - HalfProducts (bfloat16 and half): the products read the half-precision values themselves and sum in float, on
//   the CPU's matrix instructions, through torch's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm,
//   oneDNN's: AMX tiles where the CPU has them, AVX512-BF16 dot products otherwise). Its operands are copied into
//   the layouts it reads (below); scores, softmax and all sums stay float, and the probabilities and score
//   gradients are rounded to the half type only for the products that read them.
// Either way the output, the output's gradient and q, k, v's gradients are in S; the log-sum-exp, the bias tables
// and the global key and value gradients in T; the key and value gradients of half precision are summed in float.
//
// Scores are in base 2 (queries times scale * log2(e), biases times log2(e) by the caller), so that the
// softmax needs exp2 only. q, k, v, the output and their gradients may be strided, with the elements of one
// token contiguous. 2D: (B, H, X, Y, D), lse (B, H, X, Y) contiguous; global_k, global_v (B, H, G, D) contiguous
// (in T, or in S for HalfProducts); rel_bias (H, (4w-1)^2) or empty; global_bias (H, G) or empty; slots (C, n, 3)
// int64: for each chunk (row-major) and neighbour slot, the chunk it reads (-1: none) and the slot's chunk offset
// (a, b), which the relative bias uses as if neighbour chunks were adjacent. 1D: (B, H, L, D), lse (B, H, L);
// rel_bias (H, 2w+1) or empty; key_padding_mask (B, L) bool or empty; one dilation per head.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// The softmax and the layouts of the half-precision products run on 16 floats (16 x 16 words) at a time where the
// compiler targets AVX-512 (F, BW and DQ, as x86-64-v4).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define VIL_AVX512 1
#else
#define VIL_AVX512 0
#endif
// float16 rows are converted 8 values at a time with F16C's instructions where the compiler targets them.
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define VIL_F16C 1
#else
#define VIL_F16C 0
#endif

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*);
}

namespace {

constexpr int kMaxSlots = 9;
constexpr double kLog2e = 1.4426950408889634;

inline int64_t even(int64_t n) { return n + (n & 1); }

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

// Row-major c (m x n, float) = a b, or c += a b where `add`; a m x k row-major, b as the micro-kernel reads it
// (reads_pairs, below): in pairs, k/2 rows of n pairs (b[2i][j], b[2i+1][j]), the layout of the CPU's half-precision
// dot-product instructions and of AMX tiles; or plain, k rows; k even. k = 0 leaves c as it is.
template <typename S>
void half_product(int m, int n, int k, const S* a, int lda, const S* b, int ldb, float* c, int ldc, bool add = false) {
  if (m == 0 || n == 0 || k == 0) return;
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, true);
}

// The polynomial of exp2_nonpositive: 2^f ~ the sum of kExp2[k] f^k for |f| <= 1/2.
constexpr float kExp2[7] = {1.0f, 0.69314718f, 0.24022646f, 0.05550329f, 0.0096185198f, 0.001339986f, 0.00015337577f};
// The same of degree 3, fitted alike, for the forward's probabilities where they are rounded to a half type before a
// product reads them: within 7.7e-5 relative, a third of float16's half ulp and a fiftieth of bfloat16's, for half the
// multiply-adds.
constexpr float kExp2Rounded[4] = {0.99992895f, 0.69327623f, 0.24260405f, 0.055088684f};

// exp2 for t <= 0 (scores less their maximum or log-sum-exp): 2^n times 2^f, n the nearest integer and f = t - n,
// |f| <= 1/2, by a polynomial of degree 6 fitted to 2^f there (least squares of the relative error at Chebyshev
// nodes), within 1.5 ulp. The polynomial is evaluated in three levels of multiply-adds (Estrin's scheme) rather than
// six (Horner's): a loop over a row of scores waits on each value's chain of latencies more than on its instructions.
// Written so that the compiler vectorises a loop over it; t <= -127 (and -inf) gives 0, since 2^-127 has a zero
// exponent field. NaN stays NaN: n's bits are read without a conversion to int, which would be undefined for NaN.
inline float exp2_nonpositive(float t) {
  t = std::max(t, -127.0f);
  const float n = std::floor(t + 0.5f);
  const float f = t - n, f2 = f * f;
  const float lower = (f * kExp2[1] + kExp2[0]) + f2 * (f * kExp2[3] + kExp2[2]);
  const float upper = (f * kExp2[5] + kExp2[4]) + f2 * kExp2[6];
  const float p = lower + (f2 * f2) * upper;
  // n + 1.5 * 2^23 holds the integer n in its low mantissa bits (0x4B400000 + n for -127 <= n <= 0); 2^n's exponent
  // field is n + 127.
  const float shifted = n + 12582912.0f;
  uint32_t low;
  std::memcpy(&low, &shifted, sizeof(low));
  const uint32_t bits = (low - 0x4B400000u + 127u) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline double exp2_nonpositive(double t) { return std::exp2(t); }

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

// Rows of n values: out = widen(in) * factor, and out = narrow(in * factor), or narrow(widen(out) + in * factor) to
// add. float16 goes through F16C's conversion instructions, 8 values at a time, where the compiler targets them (the
// x86-64-v3 and v4 builds; rounding to nearest even, as c10): c10's float16 conversions are scalar code that the
// loops do not vectorise (float16 inputs took 1.4x the time of bfloat16 ones with float32 products). The other types
// go through widen and narrow, which the loops vectorise.
#if VIL_F16C
struct HalfLanes {
  static constexpr int kWidth = 8;
  static __m256 widen(const c10::Half* at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  }
  static void narrow(c10::Half* at, __m256 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

template <typename S, typename T>
constexpr bool kHalfLanes = std::is_same_v<S, c10::Half> && std::is_same_v<T, float>;
#endif

template <typename T, typename S>
inline void widen_row(T* out, const S* in, int64_t n, T factor) {
  int64_t d = 0;
#if VIL_F16C
  if constexpr (kHalfLanes<S, T>) {
    for (; d + HalfLanes::kWidth <= n; d += HalfLanes::kWidth) {
      _mm256_storeu_ps(out + d, _mm256_mul_ps(HalfLanes::widen(in + d), _mm256_set1_ps(factor)));
    }
  }
#endif
  for (; d < n; ++d) out[d] = widen<T>(in[d]) * factor;
}

template <typename S, typename T>
inline void narrow_row(S* out, const T* in, int64_t n, T factor, bool add) {
  int64_t d = 0;
#if VIL_F16C
  if constexpr (kHalfLanes<S, T>) {
    for (; d + HalfLanes::kWidth <= n; d += HalfLanes::kWidth) {
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(in + d), _mm256_set1_ps(factor));
      if (add) x = _mm256_add_ps(HalfLanes::widen(out + d), x);
      HalfLanes::narrow(out + d, x);
    }
  }
#endif
  for (; d < n; ++d) out[d] = narrow<S>(add ? widen<T>(out[d]) + in[d] * factor : in[d] * factor);
}

// What turns the products of a chunk (block) into its base-2 scores, where the softmax applies it as it reads each
// row instead of in a pass of its own: times `factor`, plus `table` (the biases, row-major with the scores' row
// length; -inf where the query does not see the key, whatever the product), or nothing where null.
template <typename T>
struct Finish {
  T factor = 1;
  const T* table = nullptr;
  Finish offset(int64_t by) const { return {factor, table == nullptr ? nullptr : table + by}; }
};

// finish applied in place to n products of one row (or of consecutive rows, where table is null).
template <typename T>
void finish_row(T* row, int64_t n, const Finish<T>& finish) {
  const T masked = -std::numeric_limits<T>::infinity(), factor = finish.factor, *table = finish.table;
  if (table != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] = table[j] == masked ? masked : row[j] * factor + table[j];
  } else if (factor != T(1)) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] *= factor;
  }
}

// Turns one row of products into base-2 scores (finish), then writes 2^(score - its maximum) to out (the row itself,
// or a row of the half type the products read), and gives the maximum and the sum (of the unrounded values). A row
// that sees no key (all -inf) gives zeros, with sum 0. A finish with a table is applied to the row in place first;
// one without, a factor alone, as each pass reads the products, which saves a pass that writes the row.
template <typename T, typename Out>
void exponentiate_row(T* row, int n, const Finish<T>& finish, Out* out, T& max, T& sum) {
  if (finish.table != nullptr) finish_row(row, n, finish);
  const T factor = finish.table != nullptr ? T(1) : finish.factor;
  T m = -std::numeric_limits<T>::infinity(), s = 0;
#pragma omp simd reduction(max : m)
  for (int j = 0; j < n; ++j) m = m > row[j] * factor ? m : row[j] * factor;  // std::max does not vectorise
  if (m == -std::numeric_limits<T>::infinity()) m = 0;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < n; ++j) {
    const T p = exp2_nonpositive(row[j] * factor - m);
    s += p;
    out[j] = narrow<Out>(p);
  }
  max = m;
  sum = s;
}

// exponentiate_row on each of n rows of `length` products, ld apart (their finish's table rows too), into outputs lo
// apart.
template <typename T, typename Out>
void exponentiate_rows(T* rows, int n, int length, int64_t ld, const Finish<T>& finish, Out* out, int64_t lo, T* max,
                       T* sum) {
  for (int i = 0; i < n; ++i) {
    exponentiate_row(rows + i * ld, length, finish.offset(i * ld), out + i * lo, max[i], sum[i]);
  }
}

// The backward of the softmax of n rows of products (row length ld): the probabilities 2^(finish(s) - lse) in place of
// the products, and the score gradients dS = P * (dP - delta) in place of dP, also added to grad_sum (a matrix of the
// same shape) where it is not null. delta = rowsum(dO * O) as given, or, where delta is null, sum_j P_ij dP_ij / sum_j
// P_ij from the rows themselves (each row holds all of its query's keys): the same number, but not off by the rounding
// of an output stored in half precision, nor by the forward's exp2 for rounded probabilities (kExp2Rounded, whose rows
// sum to 1 within 1e-4), either of which would leave each row of dS summing to that error rather than to zero (and the
// bias gradients, sums of dS over many queries, off by far more than the dtype's precision).
template <typename T>
void softmax_backward(int n, int ld, T* scores, T* grad_scores, const T* lse, const T* delta, const Finish<T>& finish,
                      T* grad_sum) {
  for (int i = 0; i < n; ++i) {
    const int64_t offset = static_cast<int64_t>(i) * ld;
    T *p = scores + offset, *ds = grad_scores + offset;
    finish_row(p, ld, finish.offset(offset));
    const T row_lse = lse[i];
    if (delta != nullptr) {
      const T row_delta = delta[i];
#pragma omp simd
      for (int j = 0; j < ld; ++j) {
        p[j] = exp2_nonpositive(p[j] - row_lse);
        ds[j] = p[j] * (ds[j] - row_delta);
      }
    } else {
      T row_delta = 0, row_total = 0;
#pragma omp simd reduction(+ : row_delta, row_total)
      for (int j = 0; j < ld; ++j) {
        p[j] = exp2_nonpositive(p[j] - row_lse);
        row_delta += p[j] * ds[j];
        row_total += p[j];
      }
      row_delta = row_total > 0 ? row_delta / row_total : T(0);
#pragma omp simd
      for (int j = 0; j < ld; ++j) ds[j] = p[j] * (ds[j] - row_delta);
    }
    if (grad_sum != nullptr) {
      T* sum = grad_sum + offset;
#pragma omp simd
      for (int j = 0; j < ld; ++j) sum[j] += ds[j];
    }
  }
}

#if VIL_AVX512
// The vector forms of the loops above for float: 16 scores at a time, the row's tail under a mask.
inline __mmask16 tail_mask(int remaining) { return static_cast<__mmask16>((1u << remaining) - 1u); }

// f(j, lanes) for the columns j = 0, 16, .. of a row of n: all 16 lanes, then the row's tail under a mask. The full
// vectors' mask is a constant, which lets the compiler drop the masking from their loads, stores and arithmetic.
template <typename F>
inline void over_lanes(int n, F&& f) {
  int j = 0;
  for (; j + 16 <= n; j += 16) f(j, __mmask16(0xffff));
  if (j < n) f(j, tail_mask(n - j));
}

// As exp2_nonpositive: the same polynomial of f times 2^n; t < -150 (and -inf) gives 0, NaN stays NaN. f = t - n comes
// from one instruction (VREDUCEPS) and n from f, beside the polynomial, which shortens each vector's chain again.
// Rounded: kExp2Rounded's polynomial instead.
template <bool Rounded = false>
inline __m512 exp2_nonpositive(__m512 t) {
  const __mmask16 seen = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-150.0f), _CMP_NLT_UQ);  // t >= -150, or NaN
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // t - n, |f| <= 1/2
  const __m512 n = _mm512_sub_ps(t, f);
  const auto c = [](int k) { return _mm512_set1_ps(Rounded ? kExp2Rounded[k] : kExp2[k]); };
  const __m512 f2 = _mm512_mul_ps(f, f);
  const __m512 lower = _mm512_fmadd_ps(f2, _mm512_fmadd_ps(f, c(3), c(2)), _mm512_fmadd_ps(f, c(1), c(0)));
  if constexpr (Rounded) {
    return _mm512_maskz_scalef_ps(seen, lower, n);
  } else {
    const __m512 upper = _mm512_fmadd_ps(f2, c(6), _mm512_fmadd_ps(f, c(5), c(4)));
    const __m512 p = _mm512_fmadd_ps(_mm512_mul_ps(f2, f2), upper, lower);
    return _mm512_maskz_scalef_ps(seen, p, n);
  }
}

// finish applied to 16 products (table: the same lanes of the finish's table row, or null).
inline __m512 finish_lanes(__m512 s, __m512 factor, const float* table, __mmask16 lanes) {
  if (table == nullptr) return _mm512_mul_ps(s, factor);
  const __m512 masked = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 t = _mm512_mask_loadu_ps(masked, lanes, table);
  return _mm512_mask3_fmadd_ps(s, factor, t, _mm512_cmp_ps_mask(t, masked, _CMP_NEQ_UQ));  // -inf where masked
}

// 16 floats rounded to bfloat16 (to nearest even, NaN kept), as narrow does one; where the build targets AVX512-BF16,
// by its one conversion instruction, which also flushes subnormals (below 1.2e-38) to zero.
inline __m256i round_to_bfloat16(__m512 x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0)));
#endif
}

// 32 floats (a's 16, then b's) rounded to bfloat16 as above: by one instruction where the build targets AVX512-BF16.
inline __m512i round_to_bfloat16(__m512 a, __m512 b) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(round_to_bfloat16(a)), round_to_bfloat16(b), 1);
#endif
}

// 16 floats rounded to half (to nearest even), as c10's conversion does one.
inline __m256i round_to_half(__m512 x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// Stores of 16 lanes, rounded to the half types. A masked store of 16-bit words only for a row's tail: compilers
// fold a masked store into the integer narrowing of round_to_bfloat16, a slow instruction on some CPUs (Zen 4).
inline void store_words(void* out, __mmask16 lanes, __m256i words) {
  if (lanes == 0xffff) {
    _mm256_storeu_si256(static_cast<__m256i*>(out), words);
  } else {
    _mm256_mask_storeu_epi16(out, lanes, words);
  }
}
inline void store_lanes(float* out, __mmask16 lanes, __m512 x) { _mm512_mask_storeu_ps(out, lanes, x); }
inline void store_lanes(c10::BFloat16* out, __mmask16 lanes, __m512 x) {
  store_words(out, lanes, round_to_bfloat16(x));
}
inline void store_lanes(c10::Half* out, __mmask16 lanes, __m512 x) { store_words(out, lanes, round_to_half(x)); }

// Stores of 32 lanes (low, then high).
template <typename Out>
inline void store_lanes(Out* out, __m512 low, __m512 high) {
  store_lanes(out, __mmask16(0xffff), low);
  store_lanes(out + 16, __mmask16(0xffff), high);
}
inline void store_lanes(c10::BFloat16* out, __m512 low, __m512 high) {
  _mm512_storeu_si512(out, round_to_bfloat16(low, high));
}

// exponentiate_row on two rows at once, each with its output and its row of one finish (the same factor, a table row
// each where it has a table): two independent chains of instructions, so that one row's instructions run while the
// other's wait for their inputs. Each pass reads both rows' lanes before it writes either, so the two may be one row.
template <typename Out>
void exponentiate_row_pair(int n, float* row0, float* row1, const Finish<float>& finish0, const Finish<float>& finish1,
                           Out* out0, Out* out1, float* max, float* sum) {
  constexpr bool rounded = !std::is_same_v<Out, float>;  // the probabilities are rounded to a half type as stored
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const bool tabled = finish0.table != nullptr;  // else the factor is applied as each pass reads the products
  const __m512 factor = _mm512_set1_ps(finish0.factor), left = tabled ? _mm512_set1_ps(1.0f) : factor;
  __m512 m0 = lowest, m1 = lowest;
  over_lanes(n, [&](int j, __mmask16 lanes) {  // the scores, and their maxima
    __m512 s0 = _mm512_mask_loadu_ps(lowest, lanes, row0 + j), s1 = _mm512_mask_loadu_ps(lowest, lanes, row1 + j);
    if (tabled) {
      s0 = finish_lanes(s0, factor, finish0.table + j, lanes);
      s1 = finish_lanes(s1, factor, finish1.table + j, lanes);
      _mm512_mask_storeu_ps(row0 + j, lanes, s0);
      _mm512_mask_storeu_ps(row1 + j, lanes, s1);
    } else {
      s0 = _mm512_mul_ps(s0, factor);
      s1 = _mm512_mul_ps(s1, factor);
    }
    m0 = _mm512_mask_max_ps(m0, lanes, s0, m0);  // not the tail's lanes: -inf times a negative scale is +inf
    m1 = _mm512_mask_max_ps(m1, lanes, s1, m1);
  });
  max[0] = _mm512_reduce_max_ps(m0), max[1] = _mm512_reduce_max_ps(m1);
  for (int r = 0; r < 2; ++r) {
    if (max[r] == -std::numeric_limits<float>::infinity()) max[r] = 0;
  }
  const __m512 shift0 = _mm512_set1_ps(max[0]), shift1 = _mm512_set1_ps(max[1]);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  auto exponentials = [&](int j, __mmask16 lanes, __m512& p0, __m512& p1) {  // of 16 columns, added to the sums
    p0 = exp2_nonpositive<rounded>(_mm512_fmsub_ps(_mm512_mask_loadu_ps(lowest, lanes, row0 + j), left, shift0));
    p1 = exp2_nonpositive<rounded>(_mm512_fmsub_ps(_mm512_mask_loadu_ps(lowest, lanes, row1 + j), left, shift1));
    sum0 = _mm512_mask_add_ps(sum0, lanes, sum0, p0);
    sum1 = _mm512_mask_add_ps(sum1, lanes, sum1, p1);
  };
  int j0 = 0;
  for (; j0 + 32 <= n; j0 += 32) {  // 32 columns at a time: stored by one conversion where the output is bfloat16
    __m512 low0, low1, high0, high1;
    exponentials(j0, 0xffff, low0, low1);
    exponentials(j0 + 16, 0xffff, high0, high1);
    store_lanes(out0 + j0, low0, high0);
    store_lanes(out1 + j0, low1, high1);
  }
  over_lanes(n - j0, [&](int j, __mmask16 lanes) {
    __m512 p0, p1;
    exponentials(j0 + j, lanes, p0, p1);
    store_lanes(out0 + j0 + j, lanes, p0);
    store_lanes(out1 + j0 + j, lanes, p1);
  });
  sum[0] = _mm512_reduce_add_ps(sum0), sum[1] = _mm512_reduce_add_ps(sum1);
}

// exponentiate_rows two rows at a time; of an odd number, the last row with itself.
template <typename Out>
void exponentiate_rows(float* rows, int n, int length, int64_t ld, const Finish<float>& finish, Out* out, int64_t lo,
                       float* max, float* sum) {
  for (int i = 0; i < n; i += 2) {
    const int next = std::min(i + 1, n - 1);
    float pair_max[2], pair_sum[2];
    exponentiate_row_pair(length, rows + i * ld, rows + next * ld, finish.offset(i * ld), finish.offset(next * ld),
                          out + i * lo, out + next * lo, pair_max, pair_sum);
    max[i] = pair_max[0], sum[i] = pair_sum[0];
    max[next] = pair_max[1], sum[next] = pair_sum[1];
  }
}

// The probabilities and score gradients of 16 columns of one row (see softmax_backward).
struct SoftmaxLanes {
  __m512 prob, grad;
};

inline __m512 probability_lanes(const float* s, const Finish<float>& finish, __m512 lse, __mmask16 lanes) {
  const __m512 finished = finish_lanes(_mm512_maskz_loadu_ps(lanes, s), _mm512_set1_ps(finish.factor),
                                       finish.table, lanes);
  return exp2_nonpositive(_mm512_sub_ps(finished, lse));
}

// The probabilities of one row of ld products in place, and delta from them: sum_j P_j dP_j / sum_j P_j (see
// softmax_backward).
inline float probabilities_and_delta(int ld, float* s, const float* dp, const Finish<float>& finish, float lse) {
  __m512 delta = _mm512_setzero_ps(), total = _mm512_setzero_ps();
  over_lanes(ld, [&](int j, __mmask16 lanes) {
    const __m512 prob = probability_lanes(s + j, finish.offset(j), _mm512_set1_ps(lse), lanes);
    _mm512_mask_storeu_ps(s + j, lanes, prob);
    delta = _mm512_fmadd_ps(prob, _mm512_maskz_loadu_ps(lanes, dp + j), delta);
    total = _mm512_mask_add_ps(total, lanes, total, prob);
  });
  const float row_total = _mm512_reduce_add_ps(total);
  return row_total > 0 ? _mm512_reduce_add_ps(delta) / row_total : 0.0f;
}

// P (computed, or read where the row holds it already) and dS = P * (dP - delta) of 16 columns.
inline SoftmaxLanes softmax_backward_lanes(const float* s, const float* dp, const Finish<float>& finish, __m512 lse,
                                           __m512 delta, __mmask16 lanes, bool probabilities) {
  const __m512 prob = probabilities ? _mm512_maskz_loadu_ps(lanes, s) : probability_lanes(s, finish, lse, lanes);
  return {prob, _mm512_mul_ps(prob, _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, dp), delta))};
}

inline void softmax_backward(int n, int ld, float* scores, float* grad_scores, const float* lse, const float* delta,
                             const Finish<float>& finish, float* grad_sum) {
  for (int i = 0; i < n; ++i) {
    const int64_t offset = static_cast<int64_t>(i) * ld;
    const float row_delta = delta != nullptr ? delta[i]
                                             : probabilities_and_delta(ld, scores + offset, grad_scores + offset,
                                                                       finish.offset(offset), lse[i]);
    const __m512 row_lse = _mm512_set1_ps(lse[i]), delta_lanes = _mm512_set1_ps(row_delta);
    over_lanes(ld, [&](int j, __mmask16 lanes) {
      const SoftmaxLanes x = softmax_backward_lanes(scores + offset + j, grad_scores + offset + j,
                                                    finish.offset(offset + j), row_lse, delta_lanes, lanes,
                                                    delta == nullptr);
      _mm512_mask_storeu_ps(scores + offset + j, lanes, x.prob);
      _mm512_mask_storeu_ps(grad_scores + offset + j, lanes, x.grad);
      if (grad_sum != nullptr) {
        float* sum = grad_sum + offset + j;
        _mm512_mask_storeu_ps(sum, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, sum), x.grad));
      }
    });
  }
}
#endif

// One query's output (its unnormalised output o over the row sum) and base-2 log-sum-exp. A query that sees no
// key outputs zeros, and its log-sum-exp is +inf, so that the backward's probabilities 2^(s - lse) are zeros.
template <typename S, typename T>
void store_output(S* out, T* lse, const T* o, int64_t D, T max, T sum) {
  const T inverse = sum > 0 ? T(1) / sum : T(0);
  narrow_row(out, o, D, inverse, false);
  *lse = sum > 0 ? max + std::log2(sum) : std::numeric_limits<T>::infinity();
}

// A token's place in a map: its row and column (1D: its position in a residue class, and column 0).
struct Position {
  int64_t row, col;
};

// One (batch, head) of a (B, H, X, Y, D) map or a (B, H, L, D) sequence: the D elements of a token are contiguous,
// tokens are `row` apart from one row (position) to the next and `col` apart from one column to the next (1D: 0).
template <typename S>
struct Map {
  S* data;
  int64_t row, col;
  S* at(int64_t r, int64_t c) const { return data + r * row + c * col; }
  S* at(Position p) const { return at(p.row, p.col); }
  // Residue class r of a dilation d of a sequence: its positions r, r + d, ... as the rows of a map.
  Map every(int64_t r, int64_t d) const { return {data + r * row, d * row, col}; }
};

template <typename S>
Map<S> map_of(const at::Tensor& t, int64_t b, int64_t h) {
  S* head = static_cast<S*>(t.data_ptr()) + b * t.stride(0) + h * t.stride(1);
  return {head, t.stride(2), t.dim() == 5 ? t.stride(3) : 0};
}

// The tokens of one query chunk (2D) or block (1D): its queries, and in 2D the local keys of its window in the order
// of the score columns where the products gather them or a backward adds their gradients (the G global keys come
// after them; a 1D block's keys are its span, Block::k0 and keys).
struct Window {
  std::vector<Position> queries, keys;
};

// dst (one token of D elements after the other) = factor * the tokens of src at `at`.
template <typename T, typename S>
void gather(T* dst, Map<const S> src, const std::vector<Position>& at, int64_t D, T factor) {
  for (size_t i = 0; i < at.size(); ++i) {
    const S* in = src.at(at[i]);
    widen_row(dst + static_cast<int64_t>(i) * D, in, D, factor);
  }
}

// The tokens of dst at `at` = src (one token after the other), or += src when `add`.
template <typename S, typename T>
void scatter(Map<S> dst, const std::vector<Position>& at, int64_t D, const T* src, bool add) {
  for (size_t i = 0; i < at.size(); ++i) {
    S* out = dst.at(at[i]);
    const T* in = src + static_cast<int64_t>(i) * D;
    narrow_row(out, in, D, T(1), add);
  }
}

// Adds n elements of src into dst.
template <typename T>
void add_into(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// Where a backward sums the key or value gradients of one (batch, head) map or residue class, from zero: the
// gradient tensor itself when it holds the compute type (and its rows are close enough for the int strides of BLAS,
// which adds the 1D products in place); else a buffer in the compute type, written to the tensor by finish (sums in
// half precision would lose the small terms). Either way the tensor needs no zeroing before.
template <typename S, typename T>
struct GradientSum {
  Map<T> target{};
  Map<S> out{};
  std::vector<T> buffer;
  int64_t rows = 0, cols = 0, D = 0;
  bool in_place = false;

  void start(Map<S> gradient, int64_t rows_, int64_t cols_, int64_t D_) {
    out = gradient, rows = rows_, cols = cols_, D = D_;
    if constexpr (std::is_same_v<S, T>) {
      in_place = gradient.row <= std::numeric_limits<int>::max();
      if (in_place) {
        target = gradient;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) std::fill(target.at(r, c), target.at(r, c) + D, T(0));
        }
        return;
      }
    }
    buffer.assign(rows * cols * D, T(0));
    target = {buffer.data(), cols * D, D};
  }
  void finish() {
    if (in_place) return;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) narrow_row(out.at(r, c), target.at(r, c), D, T(1), false);
    }
  }
};

struct Geometry {
  int64_t B, H, X, Y, D, G;
  int w, exact, chunk_cols, num_slots;
  // Whether each key block takes an even number of score columns, the last one masked where the block has an odd
  // number of keys: so that the half-precision products can read the keys of consecutive blocks in pairs, in place
  // (MapLayouts).
  bool even_blocks = false;
  int64_t chunks() const { return ((X + w - 1) / w) * chunk_cols; }
  // A chunk, and each key block it reads, is a w x w tile clipped to the map: a window wider than a thin map
  // needs no w x w buffers.
  int64_t max_queries() const { return std::min<int64_t>(w, X) * std::min<int64_t>(w, Y); }
  int64_t block_columns(int64_t keys) const { return even_blocks ? even(keys) : keys; }
  int64_t max_keys() const { return num_slots * block_columns(max_queries()) + G; }
  int64_t bias_rows() const { return static_cast<int64_t>(4 * w - 1) * (4 * w - 1); }  // offsets -(2w-1)..2w-1
};

// One query chunk: its queries (rows q_r0.., columns q_c0..) and the key block of each slot it reads (the chunk
// `read`), laid out slot after slot, row-major within a slot, from score column `start` (Geometry::even_blocks: an
// odd block followed by a masked column); `keys` score columns in all.
struct Chunk {
  int q_r0, q_c0, q_rows, q_cols;
  int slots = 0, keys = 0;
  int read[kMaxSlots], k_r0[kMaxSlots], k_c0[kMaxSlots], k_rows[kMaxSlots], k_cols[kMaxSlots];
  int a[kMaxSlots], b[kMaxSlots], start[kMaxSlots];
  int queries() const { return q_rows * q_cols; }
};

// A chunk's tile of the map: rows r0.., columns c0.., a w x w square clipped to the map.
struct Tile {
  int r0, c0, rows, cols;
};

Tile tile_of(const Geometry& g, int64_t chunk) {
  const int r0 = static_cast<int>(chunk / g.chunk_cols) * g.w, c0 = static_cast<int>(chunk % g.chunk_cols) * g.w;
  return {r0, c0, static_cast<int>(std::min<int64_t>(g.w, g.X - r0)),
          static_cast<int>(std::min<int64_t>(g.w, g.Y - c0))};
}

Chunk make_chunk(const Geometry& g, const int64_t* slot_table, int64_t chunk) {
  Chunk c;
  const Tile queries = tile_of(g, chunk);
  c.q_r0 = queries.r0, c.q_c0 = queries.c0, c.q_rows = queries.rows, c.q_cols = queries.cols;
  for (int s = 0; s < g.num_slots; ++s) {
    const int64_t* entry = slot_table + (chunk * g.num_slots + s) * 3;
    if (entry[0] < 0) continue;
    const int i = c.slots++;
    const Tile keys = tile_of(g, entry[0]);
    c.read[i] = static_cast<int>(entry[0]);
    c.k_r0[i] = keys.r0, c.k_c0[i] = keys.c0, c.k_rows[i] = keys.rows, c.k_cols[i] = keys.cols;
    c.a[i] = static_cast<int>(entry[1]);
    c.b[i] = static_cast<int>(entry[2]);
    c.start[i] = c.keys;
    c.keys += static_cast<int>(g.block_columns(c.k_rows[i] * c.k_cols[i]));
  }
  return c;
}

// The chunk's queries, and its keys where `keys` (a masked column of even_blocks: kMaskedKey).
constexpr Position kMaskedKey{-1, -1};
void set_window(const Chunk& c, Window& win, bool keys) {
  win.queries.clear();
  win.keys.clear();
  for (int r = 0; r < c.q_rows; ++r) {
    for (int col = 0; col < c.q_cols; ++col) win.queries.push_back({c.q_r0 + r, c.q_c0 + col});
  }
  if (!keys) return;
  for (int s = 0; s < c.slots; ++s) {
    for (int r = 0; r < c.k_rows[s]; ++r) {
      for (int col = 0; col < c.k_cols[s]; ++col) win.keys.push_back({c.k_r0[s] + r, c.k_c0[s] + col});
    }
    const int end = s + 1 < c.slots ? c.start[s + 1] : c.keys;
    win.keys.resize(end, kMaskedKey);
  }
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
  // The most keys a block's windows cover, with the one before where that span would begin at an odd position.
  int64_t span() const { return std::min<int64_t>(block + (causal ? 1 : 2) * w + 1, L); }
  int64_t max_queries() const { return block; }
  int64_t max_keys() const { return span() + G; }
  int64_t bias_rows() const { return 2 * w + 1; }  // offsets -w..w
  // The positions of residue class r of dilation d: r, r + d, ... below L.
  int64_t class_length(int64_t r, int64_t d) const { return (L - r + d - 1) / d; }
};

// A block of queries t0 <= t < t0 + queries of residue class r of head h (positions r + d*t), and the span of
// keys k0 <= t < k0 + keys that their windows cover, from an even k0 (the half-precision products read a span's
// keys in pairs from the class's layouts, see ClassLayouts); `run` numbers the (head, residue class).
struct Block {
  int64_t h, d, r, t0, k0, run;
  int queries, keys;
};

// The blocks of one batch entry, by head, residue class and position; runs[i] is where the i-th (head, residue
// class) begins, and runs.back() the end.
std::vector<Block> make_blocks(const Geometry1d& g, std::vector<int64_t>& runs) {
  std::vector<Block> blocks;
  for (int64_t h = 0; h < g.H; ++h) {
    const int64_t d = g.dilations[h];
    for (int64_t r = 0; r < std::min(d, g.L); ++r) {
      const int64_t run = static_cast<int64_t>(runs.size()), n = g.class_length(r, d);
      runs.push_back(static_cast<int64_t>(blocks.size()));
      for (int64_t t0 = 0; t0 < n; t0 += g.block) {
        const int64_t queries = std::min<int64_t>(g.block, n - t0), k0 = std::max<int64_t>(0, t0 - g.w) / 2 * 2;
        const int64_t k1 = std::min(n, t0 + queries + (g.causal ? 0 : g.w));
        blocks.push_back({h, d, r, t0, k0, run, static_cast<int>(queries), static_cast<int>(k1 - k0)});
      }
    }
  }
  runs.push_back(static_cast<int64_t>(blocks.size()));
  return blocks;
}

// The positions of a block's queries in its residue class.
void set_window(const Block& blk, Window& win) {
  win.queries.clear();
  for (int i = 0; i < blk.queries; ++i) win.queries.push_back({blk.t0 + i, 0});
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

template <typename T>
const T* head_of(const at::Tensor& t, int64_t bh, int64_t per_head) {
  return t.numel() == 0 ? nullptr : static_cast<const T*>(t.data_ptr()) + bh * per_head;
}

template <typename T>
T* grad_of(at::Tensor& t, int64_t bh, int64_t per_head) {
  return t.numel() == 0 ? nullptr : t.data_ptr<T>() + bh * per_head;
}

template <typename T>
void add_global_bias(T* row, int local, const T* global_bias, int64_t G) {
  if (global_bias == nullptr) return;
  for (int64_t j = 0; j < G; ++j) row[local + j] += global_bias[j];
}

// Adds the biases to the scores of a chunk (row length ld), and -inf where a query does not see a key.
template <typename T>
void mask_scores(const Geometry& g, const Chunk& c, T* scores, int ld, const T* rel_bias, const T* global_bias) {
  const T masked = -std::numeric_limits<T>::infinity();
  for (int i = 0; i < c.queries(); ++i) {
    T* row = scores + static_cast<int64_t>(i) * ld;
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

// The biases and masks a chunk's scores get depend only on its kind: its shape, and the shape and offset of each
// slot it reads. Interior chunks are all of one kind, so each (kind, head) has its biases written once per call,
// by mask_scores on zeros, into a dense queries x (keys + G) table that the softmax adds as it reads the scores;
// the backward sums the score gradients of each kind in such a table and adds them to the bias gradients once per
// kind. Where the tables would exceed kTableBudget values, the scores are masked row by row instead.
constexpr int64_t kTableBudget = int64_t(1) << 22;

template <typename T>
struct ChunkBiases {
  std::vector<int> kind_of;     // per chunk
  std::vector<int64_t> sample;  // per kind: a chunk of that kind
  std::vector<int64_t> start;   // per (kind, head): where its table begins in `tables`
  std::vector<T> tables;
  bool none = false;   // no bias and no mask: the scores stay as they are
  bool dense = false;  // the tables are built
  int64_t H = 0;
  const T* table(int kind, int64_t h) const { return tables.data() + start[kind * H + h]; }
  int64_t size(int kind) const { return start[kind * H + 1] - start[kind * H]; }  // per head
};

template <typename T>
ChunkBiases<T> chunk_biases(const Geometry& g, const int64_t* slot_table, const at::Tensor& rel_bias,
                            const at::Tensor& global_bias) {
  ChunkBiases<T> cb;
  cb.H = g.H;
  std::map<std::vector<int>, int> kinds;
  bool masked_columns = false;  // of even_blocks
  for (int64_t chunk = 0; chunk < g.chunks(); ++chunk) {
    const Chunk c = make_chunk(g, slot_table, chunk);
    std::vector<int> shape{c.q_rows, c.q_cols};
    for (int s = 0; s < c.slots; ++s) {
      shape.insert(shape.end(), {c.a[s], c.b[s], c.k_rows[s], c.k_cols[s]});
      masked_columns = masked_columns || c.k_rows[s] * c.k_cols[s] % 2 != 0;
    }
    const auto found = kinds.emplace(shape, static_cast<int>(cb.sample.size()));
    if (found.second) cb.sample.push_back(chunk);
    cb.kind_of.push_back(found.first->second);
  }
  cb.none = rel_bias.numel() == 0 && global_bias.numel() == 0 && g.exact != 1 && !(g.even_blocks && masked_columns);
  if (cb.none) return cb;
  int64_t total = 0;
  for (const int64_t chunk : cb.sample) {
    const Chunk c = make_chunk(g, slot_table, chunk);
    for (int64_t h = 0; h < g.H; ++h) {
      cb.start.push_back(total);
      total += c.queries() * (c.keys + g.G);
    }
  }
  cb.start.push_back(total);
  if (total > kTableBudget) return cb;
  cb.tables.assign(total, T(0));
  const int64_t table = g.bias_rows();
  at::parallel_for(0, static_cast<int64_t>(cb.sample.size()) * g.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Chunk c = make_chunk(g, slot_table, cb.sample[item / g.H]);
      const int64_t h = item % g.H;
      mask_scores(g, c, cb.tables.data() + cb.start[item], c.keys + static_cast<int>(g.G),
                  head_of<T>(rel_bias, h, table), head_of<T>(global_bias, h, g.G));
    }
  });
  cb.dense = true;
  return cb;
}

// The tables of recent calls, by everything they are made of, compared bit for bit: the map's geometry, the slot
// table and the bias values. Inference calls the kernel with the same biases batch after batch (each layer its
// own), and a backward with those of its forward. Kept: the most recent call's, and older ones up to kRecentCalls
// calls and kTableBudget values in all, keys included (training changes the biases at every step: the calls
// without tables must not pile up).
constexpr int64_t kRecentCalls = 64;
template <typename T>
std::shared_ptr<const ChunkBiases<T>> recent_chunk_biases(const Geometry& g, const int64_t* slot_table,
                                                         const at::Tensor& rel_bias, const at::Tensor& global_bias) {
  std::string key;
  auto append = [&key](const void* data, int64_t bytes) {
    if (bytes > 0) key.append(static_cast<const char*>(data), static_cast<size_t>(bytes));
  };
  const int64_t shape[] = {g.X, g.Y, g.w, g.exact, g.G, g.H, g.num_slots, g.even_blocks, rel_bias.numel(),
                           global_bias.numel()};
  append(shape, sizeof(shape));
  append(slot_table, static_cast<int64_t>(sizeof(int64_t)) * g.chunks() * g.num_slots * 3);
  for (const at::Tensor* t : {&rel_bias, &global_bias}) {
    append(t->data_ptr(), t->numel() * static_cast<int64_t>(sizeof(T)));
  }
  static std::mutex mutex;
  static std::list<std::pair<std::string, std::shared_ptr<const ChunkBiases<T>>>> recent;  // the latest first
  {
    const std::lock_guard<std::mutex> lock(mutex);
    for (auto it = recent.begin(); it != recent.end(); ++it) {
      if (it->first == key) {
        recent.splice(recent.begin(), recent, it);
        return recent.front().second;
      }
    }
  }
  auto built = std::make_shared<const ChunkBiases<T>>(chunk_biases<T>(g, slot_table, rel_bias, global_bias));
  const std::lock_guard<std::mutex> lock(mutex);
  recent.emplace_front(std::move(key), built);
  int64_t kept = 0, calls = 0;
  for (auto it = recent.begin(); it != recent.end();) {
    kept += static_cast<int64_t>(it->second->tables.size() + it->first.size() / sizeof(T));
    const bool over = kept > kTableBudget || ++calls > kRecentCalls;
    it = it != recent.begin() && over ? recent.erase(it) : std::next(it);
  }
  return built;
}

// The scores of chunk `chunk` of head h, from the products: times `factor` (the scale, where the products did not
// apply it), plus the biases and masks. With dense tables, or with neither biases nor masks, that is left to the
// softmax (the Finish returned); else it is done here, row by row, and nothing is left.
template <typename T>
Finish<T> finish_scores(const Geometry& g, const Chunk& c, int64_t chunk, int64_t h, const ChunkBiases<T>& biases,
                        T* scores, int ld, T factor, const T* rel_bias, const T* global_bias) {
  if (biases.dense) return {factor, biases.table(biases.kind_of[chunk], h)};
  if (biases.none) return {factor, nullptr};
  finish_row(scores, static_cast<int64_t>(c.queries()) * ld, Finish<T>{factor});  // the scale, before the biases
  mask_scores(g, c, scores, ld, rel_bias, global_bias);
  return {};
}

// Adds the score gradients of a chunk (its queries' rows, of length ld) to the bias gradients: those of the
// relative bias table (grad_rel, or null) along the runs of keys each query sees, those of the global biases
// (grad_glob, or null).
template <typename T>
void add_bias_gradients(const Geometry& g, const Chunk& c, const T* grad_scores, int ld, T* grad_rel, T* grad_glob) {
  for (int i = 0; i < c.queries(); ++i) {
    const T* row = grad_scores + static_cast<int64_t>(i) * ld;
    if (grad_rel != nullptr) {
      for_each_visible_run(g, c, i / c.q_cols, i % c.q_cols, [&](int first, int length, int bias_row) {
        for (int j = 0; j < length; ++j) grad_rel[bias_row - j] += row[first + j];
      });
    }
    if (grad_glob != nullptr) add_into(grad_glob, row + c.keys, g.G);
  }
}

// The scores of a block (row length ld), from the products: times `factor` (the scale, where the products did not
// apply it), plus the biases, and -inf outside each query's band, after the query when causal, and at padded keys
// (key_padding: the batch entry's mask, or null; key_mask: a buffer of the span's length). Without biases and
// padding, a positive factor is left to the softmax (the Finish returned): only the -inf are written here.
template <typename T>
Finish<T> finish_scores(const Geometry1d& g, const Block& blk, T* scores, int ld, T factor, const T* rel_bias,
                        const T* global_bias, const bool* key_padding, T* key_mask) {
  const T masked = -std::numeric_limits<T>::infinity();
  const bool band_only = rel_bias == nullptr && global_bias == nullptr && key_padding == nullptr && factor > T(0);
  if (key_padding != nullptr) {
    for (int j = 0; j < blk.keys; ++j) key_mask[j] = key_padding[blk.r + blk.d * (blk.k0 + j)] ? masked : T(0);
  }
  for (int i = 0; i < blk.queries; ++i) {
    T* row = scores + static_cast<int64_t>(i) * ld;
    const Band band = band_of(g, blk, i);
    std::fill(row, row + band.lo, masked);
    std::fill(row + band.hi, row + blk.keys, masked);
    if (band_only) continue;
    if (factor != T(1)) {
#pragma omp simd
      for (int j = band.lo; j < band.hi; ++j) row[j] *= factor;
      for (int64_t j = 0; j < g.G; ++j) row[blk.keys + j] *= factor;
    }
    if (rel_bias != nullptr) {
      const T* bias = rel_bias + band.bias_row;  // key j's row is bias_row + j - lo
#pragma omp simd
      for (int j = band.lo; j < band.hi; ++j) row[j] += bias[j - band.lo];
    }
    if (key_padding != nullptr) {  // chosen, not added: a padded key's score may be NaN (keys of any value)
#pragma omp simd
      for (int j = band.lo; j < band.hi; ++j) row[j] = key_mask[j] == masked ? masked : row[j];
    }
    add_global_bias(row, blk.keys, global_bias, g.G);
  }
  return band_only ? Finish<T>{factor} : Finish<T>{};
}

// The tensors of one call.
struct Inputs {
  const at::Tensor &q, &k, &v, &global_k, &global_v, &rel_bias, &global_bias;
};

struct Gradients {
  at::Tensor &q, &k, &v, &global_k, &global_v, &rel_bias, &global_bias;
};

// Memory that one call writes and a later one can use again: the layouts that a call writes its keys and values into
// (ClassLayouts, MapLayouts), megabytes each. Memory freshly allocated at that size is mapped anew by the system, at a
// page fault per 4 KB on first touch and an unmapping when freed: up to a quarter of the 1D forward's own work on a
// 2-core Xeon (BENCHMARKS.md). A Scratch takes the smallest kept buffer that fits, or allocates one, and gives it back
// when it goes; the buffers given back most recently are kept, up to kKeptScratchBytes (128 MB) in all.
constexpr int64_t kKeptScratchBytes = int64_t(1) << 27;
class Scratch {
 public:
  Scratch() = default;
  explicit Scratch(int64_t bytes) : buffer_(take(bytes)) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  Scratch& operator=(Scratch&& other) {
    give_back(std::move(buffer_));
    buffer_ = std::move(other.buffer_);
    return *this;
  }
  ~Scratch() { give_back(std::move(buffer_)); }
  template <typename T>
  T* data() const {
    return static_cast<T*>(buffer_.data_ptr());
  }

 private:
  at::Tensor buffer_;
  struct Kept {
    std::mutex mutex;
    std::list<at::Tensor> buffers;  // the latest given back first
  };
  static Kept& kept() {
    static Kept* const kept = new Kept;  // never destroyed: no tensor is freed after torch's allocator at exit
    return *kept;
  }
  static at::Tensor take(int64_t bytes) {
    Kept& k = kept();
    {
      const std::lock_guard<std::mutex> lock(k.mutex);
      auto best = k.buffers.end();
      for (auto it = k.buffers.begin(); it != k.buffers.end(); ++it) {
        const int64_t size = static_cast<int64_t>(it->nbytes());
        if (size >= bytes && (best == k.buffers.end() || size < static_cast<int64_t>(best->nbytes()))) best = it;
      }
      if (best != k.buffers.end()) {
        at::Tensor buffer = std::move(*best);
        k.buffers.erase(best);
        return buffer;
      }
    }
    return at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  }
  static void give_back(at::Tensor buffer) {
    if (!buffer.defined()) return;
    Kept& k = kept();
    const std::lock_guard<std::mutex> lock(k.mutex);
    k.buffers.push_front(std::move(buffer));
    int64_t total = 0;
    for (auto it = k.buffers.begin(); it != k.buffers.end();) {
      total += static_cast<int64_t>(it->nbytes());
      it = total > kKeptScratchBytes ? k.buffers.erase(it) : std::next(it);
    }
  }
};

// The keys and values of residue class `item` (batch entry * classes + run, runs as make_blocks gives them) of a 1D
// call, and its length.
template <typename S>
struct ClassTokens {
  Map<const S> k, v;
  int64_t length;
};

template <typename S>
ClassTokens<S> class_tokens(const Geometry1d& g, const Inputs& in, const std::vector<int64_t>& runs,
                            const std::vector<Block>& blocks, int64_t item) {
  const int64_t classes = static_cast<int64_t>(runs.size()) - 1, b = item / classes;
  const Block& first = blocks[runs[item % classes]];
  return {map_of<const S>(in.k, b, first.h).every(first.r, first.d),
          map_of<const S>(in.v, b, first.h).every(first.r, first.d), g.class_length(first.r, first.d)};
}

// The keys and values of a call in the compute type T, written once (and converted from a half type once), sequence by
// sequence (the residue classes of ClassLayouts): a run of consecutive keys of a sequence is then rows k0.. of its
// layouts, which BLAS reads in place, where otherwise each key would be gathered for every block that reads it. The
// constructor's arguments are KeyLayouts'.
template <typename S, typename T>
struct FloatKeyLayouts {
  using Storage = S;
  int64_t D;
  std::vector<int64_t> offsets;  // per sequence: the row of its first key
  Scratch keys, values;

  template <typename F>
  FloatKeyLayouts(const std::vector<int64_t>& lengths, int64_t D_, bool /*backward*/, F&& tokens) : D(D_) {
    int64_t rows = 0;
    for (const int64_t n : lengths) {
      offsets.push_back(rows);
      rows += n;
    }
    keys = Scratch(rows * D * static_cast<int64_t>(sizeof(T)));
    values = Scratch(rows * D * static_cast<int64_t>(sizeof(T)));
    at::parallel_for(0, static_cast<int64_t>(lengths.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<const S*> k_tokens, v_tokens;
      for (int64_t item = begin; item < end; ++item) {
        tokens(item, k_tokens, v_tokens);
        T* key_rows = keys.data<T>() + offsets[item] * D;
        T* value_rows = values.data<T>() + offsets[item] * D;
        for (int64_t t = 0; t < lengths[item]; ++t) {
          widen_row(key_rows + t * D, k_tokens[t], D, T(1));
          widen_row(value_rows + t * D, v_tokens[t], D, T(1));
        }
      }
    });
  }

  // Keys (values) k0.. of sequence `item`.
  const T* keys_at(int64_t item, int64_t k0) const { return keys.data<T>() + (offsets[item] + k0) * D; }
  const T* values_at(int64_t item, int64_t k0) const { return values.data<T>() + (offsets[item] + k0) * D; }
};

// 1D: the keys and values of each residue class (item: batch entry * classes + run) in Layouts (FloatKeyLayouts or
// KeyLayouts), where a block's span of keys is read (block + 2w) / block times.
template <typename Layouts>
struct ClassLayouts : Layouts {
  using S = typename Layouts::Storage;
  ClassLayouts(const Geometry1d& g, const Inputs& in, const std::vector<int64_t>& runs,
               const std::vector<Block>& blocks, bool backward)
      : Layouts(class_lengths(g, in, runs, blocks), g.D, backward,
                [&](int64_t item, std::vector<const S*>& k, std::vector<const S*>& v) {
                  const ClassTokens<S> c = class_tokens<S>(g, in, runs, blocks, item);
                  k.resize(c.length);
                  v.resize(c.length);
                  for (int64_t t = 0; t < c.length; ++t) k[t] = c.k.at(t, 0), v[t] = c.v.at(t, 0);
                }) {}
  static std::vector<int64_t> class_lengths(const Geometry1d& g, const Inputs& in, const std::vector<int64_t>& runs,
                                            const std::vector<Block>& blocks) {
    std::vector<int64_t> lengths;
    for (int64_t item = 0; item < g.B * (static_cast<int64_t>(runs.size()) - 1); ++item) {
      lengths.push_back(class_tokens<S>(g, in, runs, blocks, item).length);
    }
    return lengths;
  }
};

// 2D with FloatProducts: each chunk's keys are gathered (and converted to T) into its buffers. Reading them in place
// from layouts written once per call (MapLayouts) instead takes three products where one does, which costs BLAS more
// than the gathers save (BENCHMARKS.md).
struct GatheredKeys {
  GatheredKeys(const Geometry& /*g*/, const Inputs& /*in*/, bool /*backward*/) {}
};

// The products of one chunk (block) in the compute type T with BLAS. Buffers: queries (times scale * log2(e)),
// keys and values of the window (local keys, then the global ones; 2D), the output's gradient, scores and their
// gradients, and the results the caller reads. Every method below is HalfProducts' too; see there.
template <typename T>
struct FloatProducts {
  using Compute = T;
  using Global = T;  // the type of the global keys and values it reads
  template <typename S>
  using ClassKeys = ClassLayouts<FloatKeyLayouts<S, T>>;
  template <typename>
  using MapKeys = GatheredKeys;
  static constexpr bool kReadsMapLayouts = false;
  std::vector<T> queries, keys, values, grad_out, scores, grad_scores, result, row_max, total, delta;
  int ld = 0;                    // score row length: local keys + G
  bool delta_from_rows = false;  // the outputs are in a half type: delta from the rows (see softmax_backward)
  // The keys and values (D elements a row) that the first `local` score columns read: in 2D all of the window's, the
  // global ones included, from the buffers above; in 1D the block's span, from its class's layouts, and the G global
  // keys and values from the inputs, multiplied apart.
  int local = 0;
  const T *key_rows = nullptr, *value_rows = nullptr, *global_keys = nullptr, *global_values = nullptr;

  FloatProducts(int64_t S, int64_t L, int64_t D)
      : queries(S * D), keys(L * D), values(L * D), grad_out(S * D), scores(S * L), grad_scores(S * L),
        result(std::max(S, L) * D), row_max(S), total(S), delta(S) {}

  // 2D: the chunk's queries, keys and values (local, then global) into the buffers.
  template <typename S>
  void load_chunk(const Window& win, const Chunk& /*c*/, const GatheredKeys& /*layouts*/, int64_t /*item*/,
                  Map<const S> q, Map<const S> k, Map<const S> v, const T* gk, const T* gv, int64_t G, int64_t D,
                  double scale, bool /*backward*/) {
    const int count = static_cast<int>(win.keys.size());
    gather(queries.data(), q, win.queries, D, T(scale * kLog2e));
    gather(keys.data(), k, win.keys, D, T(1));
    gather(values.data(), v, win.keys, D, T(1));
    std::copy(gk, gk + G * D, keys.begin() + count * D);
    std::copy(gv, gv + G * D, values.begin() + count * D);
    ld = local = count + static_cast<int>(G);
    key_rows = keys.data(), value_rows = values.data();
  }

  // 1D: the block's queries into the buffers; its span of keys and values from `layouts` (class `item`: batch entry
  // * classes + run), the global ones from the inputs.
  template <typename S>
  void load_span(const Window& win, const Block& blk, const ClassKeys<S>& layouts, int64_t item, Map<const S> q,
                 const T* gk, const T* gv, int64_t G, int64_t D, double scale, bool /*backward*/) {
    gather(queries.data(), q, win.queries, D, T(scale * kLog2e));
    local = blk.keys, ld = local + static_cast<int>(G);
    key_rows = layouts.keys_at(item, blk.k0), value_rows = layouts.values_at(item, blk.k0);
    global_keys = gk, global_values = gv;
  }

  // out (n x ld) = rows (n x D: queries or the output's gradient) times the keys' (or values') transposes: the local
  // ones, then the global ones.
  void multiply_transposed(int n, int64_t D, const T* rows, const T* local_keys, const T* global, T* out) const {
    matmul<T>(false, true, n, local, D, T(1), rows, D, local_keys, D, T(0), out, ld);
    if (ld > local) matmul<T>(false, true, n, ld - local, D, T(1), rows, D, global, D, T(0), out + local, ld);
  }

  // out (n x D) = factor * rows (n x ld: P or dS) times the keys (or values): the local ones, then the global ones.
  void multiply(int n, int64_t D, T factor, const T* rows, const T* local_keys, const T* global, T* out) const {
    matmul<T>(false, false, n, D, local, factor, rows, ld, local_keys, D, T(0), out, D);
    if (ld > local) matmul<T>(false, false, n, D, ld - local, factor, rows + local, ld, global, D, T(1), out, D);
  }

  // The products of the queries and keys; the scale is in the queries already.
  T* multiply_scores(int n, int64_t D) {
    multiply_transposed(n, D, queries.data(), key_rows, global_keys, scores.data());
    return scores.data();
  }
  T score_factor() const { return T(1); }

  const T* attend(int n, int64_t D, const Finish<T>& finish) {
    exponentiate_rows(scores.data(), n, ld, ld, finish, scores.data(), ld, row_max.data(), total.data());
    multiply(n, D, T(1), scores.data(), value_rows, global_values, result.data());
    return result.data();
  }

  template <typename S>
  void load_grad_out(const Window& win, Map<const S> grad_out_map, Map<const S> out, int64_t D) {
    gather(grad_out.data(), grad_out_map, win.queries, D, T(1));
    delta_from_rows = !std::is_same_v<S, T>;
    if (delta_from_rows) return;
    for (size_t i = 0; i < win.queries.size(); ++i) {
      const S* o = out.at(win.queries[i]);
      const T* dout = grad_out.data() + static_cast<int64_t>(i) * D;
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < D; ++d) sum += dout[d] * widen<T>(o[d]);
      delta[i] = sum;
    }
  }

  // The score gradients (also added to grad_sum where not null) from the products of the scores (see Finish).
  void differentiate(int n, int64_t D, const T* lse, const Finish<T>& finish, T* grad_sum) {
    multiply_transposed(n, D, grad_out.data(), value_rows, global_values, grad_scores.data());
    softmax_backward(n, ld, scores.data(), grad_scores.data(), lse, delta_from_rows ? nullptr : delta.data(), finish,
                     grad_sum);
  }

  const T* grad_queries(int n, int64_t D, double scale) {
    multiply(n, D, T(scale), grad_scores.data(), key_rows, global_keys, result.data());
    return result.data();
  }
  // 1D: the key and value gradients of one residue class, summed as rows (GradientSum), which the products add to
  // in place.
  template <typename S>
  struct ClassGradients {
    GradientSum<S, T> keys, values;
    void start(Map<S> grad_k, Map<S> grad_v, int64_t length, int64_t D, double /*scale: in the queries*/) {
      keys.start(grad_k, length, 1, D);
      values.start(grad_v, length, 1, D);
    }
    void finish() {
      keys.finish();
      values.finish();
    }
  };

  // 1D: adds the gradients of the block's span of keys and values (from key k0 of its class) to the class's sums,
  // and those of the global keys and values to global_k and global_v (G x D).
  template <typename S>
  void add_key_value_gradients(int n, int64_t D, int64_t k0, ClassGradients<S>& sums, T* global_k, T* global_v) const {
    const Map<T> dk = sums.keys.target, dv = sums.values.target;
    const int ldk = static_cast<int>(dk.row), ldv = static_cast<int>(dv.row), G = ld - local;
    const T key_factor = T(1 / kLog2e);  // the queries hold scale * log2(e)
    matmul<T>(true, false, local, D, n, key_factor, grad_scores.data(), ld, queries.data(), D, T(1), dk.at(k0, 0), ldk);
    matmul<T>(true, false, local, D, n, T(1), scores.data(), ld, grad_out.data(), D, T(1), dv.at(k0, 0), ldv);
    if (G == 0) return;
    matmul<T>(true, false, G, D, n, key_factor, grad_scores.data() + local, ld, queries.data(), D, T(1), global_k, D);
    matmul<T>(true, false, G, D, n, T(1), scores.data() + local, ld, grad_out.data(), D, T(1), global_v, D);
  }

  // 2D: adds the gradients of the window's keys and values to the map's sums (dk, dv: the local keys, at win.keys)
  // and to global_k and global_v (G x D).
  void add_window_gradients(int n, int64_t D, const Window& win, double /*scale: in the queries*/, Map<T> dk, Map<T> dv,
                            T* global_k, T* global_v) {
    const int64_t keys = static_cast<int64_t>(win.keys.size());
    auto add = [&](T factor, const T* products, const T* rows, Map<T> sum, T* global) {
      matmul<T>(true, false, ld, D, n, factor, products, ld, rows, D, T(0), result.data(), D);
      scatter(sum, win.keys, D, result.data(), true);
      add_into(global, result.data() + keys * D, (ld - keys) * D);
    };
    add(T(1 / kLog2e), grad_scores.data(), queries.data(), dk, global_k);
    add(T(1), scores.data(), grad_out.data(), dv, global_v);
  }

  static void release() {}
};

// The half-precision operand layouts: each writes n tokens (pointers to D contiguous elements) or n rows of a
// float matrix, with zeros where a layout is longer than its data.
//
// A operands (row-major, the summed index contiguous): the tokens as rows (n x Dp), or as columns (D x np).
template <typename S>
void write_rows(S* dst, const S* const* tokens, int n, int64_t D, int64_t Dp) {
  for (int j = 0; j < n; ++j) {
    std::copy(tokens[j], tokens[j] + D, dst + j * Dp);
    std::fill(dst + j * Dp + D, dst + (j + 1) * Dp, S(0));
  }
}

#if VIL_AVX512
// Transposes 16 rows of 16 32-bit words in registers: 32-bit, then 64-bit interleaves within 128-bit lanes, then two
// rounds of lane shuffles.
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + c], lane k: rows g..g+3 of column 4k + c
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), y = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i z = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(x, z, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(y, w, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(x, z, 0xdd);
    r[12 + c] = _mm512_shuffle_i32x4(y, w, 0xdd);
  }
}

// The 16-bit lanes that interleave 16 words from `first` with 16 from `second`: of a (0..31) and b (32..63) for a
// permutex2var, or of one vector's halves (0 and 16) for a permutexvar.
inline __m512i interleave_index(int first, int second) {
  alignas(64) uint16_t index[32];
  for (int k = 0; k < 16; ++k) {
    index[2 * k] = static_cast<uint16_t>(first + k);
    index[2 * k + 1] = static_cast<uint16_t>(second + k);
  }
  return _mm512_load_si512(index);
}
#endif

// The tokens as columns, D x np (np even). A row's 32-bit words are the pairs (token 2i, token 2i + 1) of an element:
// 16 elements of 32 tokens at a time are such pairs transposed, 16 x 16 words.
template <typename S>
void write_columns(S* dst, const S* const* tokens, int n, int np, int64_t D) {
  int64_t d0 = 0;
#if VIL_AVX512
  static_assert(sizeof(S) == 2, "the columns of 16-bit tokens");
  const __m512i pairs = interleave_index(0, 32), zero = _mm512_setzero_si512();
  const int words = np / 2;
  auto elements = [&](int token) {  // 16 elements from d0, zeros after the last token
    if (token >= n) return zero;
    return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tokens[token] + d0)));
  };
  for (; d0 + 16 <= D; d0 += 16) {
    over_lanes(words, [&](int i0, __mmask16 lanes) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) {
        const int j = 2 * (i0 + t);
        r[t] = _mm512_permutex2var_epi16(elements(j), pairs, elements(j + 1));
      }
      transpose_16x16(r);
      for (int t = 0; t < 16; ++t) _mm512_mask_storeu_epi32(dst + (d0 + t) * np + 2 * i0, lanes, r[t]);
    });
  }
#endif
  for (int64_t d = d0; d < D; ++d) {
    S* row = dst + d * np;
    for (int j = 0; j < n; ++j) row[j] = tokens[j][d];
    std::fill(row + n, row + np, S(0));
  }
}

// B operands (pairs), in rows of ldb >= n pairs, zeros after n (ldb a multiple of 16: pairs_per_row): summing over
// the tokens' elements, Dp/2 rows of n pairs (token j's elements 2e and 2e + 1); summing over the tokens, np/2 rows
// of D pairs (element d of tokens 2i and 2i + 1).
inline int pairs_per_row(int64_t n) { return static_cast<int>((n + 15) / 16 * 16); }

template <typename S>
void write_element_pairs(S* dst, const S* const* tokens, int n, int64_t D, int ldb) {
  const int64_t words = D / 2;  // whole pairs of a token
  int j0 = 0;
#if VIL_AVX512
  for (; j0 + 16 <= n; j0 += 16) {  // 16 tokens x 16 pairs at a time
    for (int64_t e0 = 0; e0 + 16 <= words; e0 += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(tokens[j0 + t] + 2 * e0);
      transpose_16x16(r);
      for (int t = 0; t < 16; ++t) _mm512_storeu_si512(dst + 2 * ((e0 + t) * ldb + j0), r[t]);
    }
  }
  const int64_t done = words - words % 16;  // pairs written above for tokens before j0
#else
  const int64_t done = 0;
#endif
  for (int j = 0; j < n; ++j) {
    const S* t = tokens[j];
    for (int64_t e = j < j0 ? done : 0; e < words; ++e) {
      uint32_t pair;
      std::memcpy(&pair, t + 2 * e, sizeof(pair));
      std::memcpy(dst + 2 * (e * ldb + j), &pair, sizeof(pair));
    }
    if (D % 2) {
      dst[2 * ((D / 2) * ldb + j)] = t[D - 1];
      dst[2 * ((D / 2) * ldb + j) + 1] = S(0);
    }
  }
  for (int64_t e = 0; e < (D + 1) / 2; ++e) std::fill(dst + 2 * (e * ldb + n), dst + 2 * (e + 1) * ldb, S(0));
}

template <typename S>
void write_token_pairs(S* dst, const S* const* tokens, int n, int64_t D, int ldb) {
#if VIL_AVX512
  const __m512i low = interleave_index(0, 32), high = interleave_index(16, 48);
#endif
  const std::vector<S> zeros(n % 2 ? D : 0, S(0));
  for (int i = 0; i < n; i += 2) {
    const S* first = tokens[i];
    const S* second = i + 1 < n ? tokens[i + 1] : zeros.data();
    S* out = dst + static_cast<int64_t>(i) * ldb;
    int64_t d = 0;
#if VIL_AVX512
    for (; d + 32 <= D; d += 32) {
      const __m512i a = _mm512_loadu_si512(first + d), b = _mm512_loadu_si512(second + d);
      _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
    }
#endif
    for (; d < D; ++d) {
      out[2 * d] = first[d];
      out[2 * d + 1] = second[d];
    }
    std::fill(out + 2 * D, out + 2 * ldb, S(0));
  }
}

// The same B operands as plain row-major matrices, k x ldb with zeros after n and in the rows up to the even k, for
// the micro-kernels that read them so (float16 on AVX512-FP16, which widens rows to float): summing over the tokens'
// elements, the tokens as columns (Dp x ldb); summing over the tokens, the tokens as rows (np x ldb).
template <typename S>
void write_element_columns(S* dst, const S* const* tokens, int n, int64_t D, int ldb) {
  write_columns(dst, tokens, n, ldb, D);
  if (D % 2) std::fill(dst + D * ldb, dst + (D + 1) * ldb, S(0));
}

template <typename S>
void write_token_rows(S* dst, const S* const* tokens, int n, int64_t D, int ldb) {
  write_rows(dst, tokens, n, D, ldb);
  if (n % 2) std::fill(dst + static_cast<int64_t>(n) * ldb, dst + static_cast<int64_t>(n + 1) * ldb, S(0));
}

// A float matrix (n rows of length ld, row stride ld) rounded to S: as an A operand (rows of length lp), or as a B
// operand summing over its rows (np/2 rows of ld pairs, in rows of ldb pairs; or, plain, np rows of ldb).
template <typename S>
void round_rows(S* dst, const float* m, int n, int ld, int lp) {
  for (int i = 0; i < n; ++i) {
    const float* row = m + static_cast<int64_t>(i) * ld;
    S* out = dst + static_cast<int64_t>(i) * lp;
    for (int j = 0; j < ld; ++j) out[j] = narrow<S>(row[j]);
    std::fill(out + ld, out + lp, S(0));
  }
}

template <typename S>
void round_even_rows(S* dst, const float* m, int n, int ld, int ldb) {
  round_rows(dst, m, n, ld, ldb);
  if (n % 2) std::fill(dst + static_cast<int64_t>(n) * ldb, dst + static_cast<int64_t>(n + 1) * ldb, S(0));
}

template <typename S>
void round_row_pairs(S* dst, const float* m, int n, int ld, int ldb) {
  for (int i = 0; i < n; i += 2) {
    const float* first = m + static_cast<int64_t>(i) * ld;
    const float* second = first + ld;
    S* out = dst + static_cast<int64_t>(i) * ldb;
    const bool pair = i + 1 < n;
    for (int j = 0; j < ld; ++j) {
      out[2 * j] = narrow<S>(first[j]);
      out[2 * j + 1] = pair ? narrow<S>(second[j]) : S(0);
    }
    std::fill(out + 2 * ld, out + 2 * ldb, S(0));
  }
}

// Where the backward of the half-precision products writes the score gradients dS and the probabilities P rounded to
// S, for the products that read them: dS as rows of lp, dS and P as row pairs in rows of ldb pairs (or, where the
// micro-kernel reads B operands plain, as rows of ldb).
template <typename S>
struct RoundedSoftmax {
  S *ds_rows, *ds_row_pairs, *p_row_pairs;
  int lp, ldb;
  bool pairs;
};

// softmax_backward with delta from the rows (the outputs are in half precision), then the roundings (P is not needed in
// float after them).
template <typename S>
void softmax_backward(int n, int ld, float* scores, float* grad_scores, const float* lse, const Finish<float>& finish,
                      float* grad_sum, const RoundedSoftmax<S>& rounded) {
  const float* from_rows = nullptr;  // typed, so that every overload of the float rows can take it
  softmax_backward(n, ld, scores, grad_scores, lse, from_rows, finish, grad_sum);
  round_rows(rounded.ds_rows, grad_scores, n, ld, rounded.lp);
  const auto round_b = rounded.pairs ? round_row_pairs<S> : round_even_rows<S>;
  round_b(rounded.ds_row_pairs, grad_scores, n, ld, rounded.ldb);
  round_b(rounded.p_row_pairs, scores, n, ld, rounded.ldb);
}

#if VIL_AVX512
// The same for bfloat16 (whose B operands are always pairs): a pass over each row for P (in place) and delta, then one
// over each pair of rows (a row pair interleaves two rows) for dS and the roundings.
inline void softmax_backward(int n, int ld, float* scores, float* grad_scores, const float* lse,
                             const Finish<float>& finish, float* grad_sum,
                             const RoundedSoftmax<c10::BFloat16>& rounded) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512i order = interleave_index(0, 16);  // the first row's words, each followed by the second's
  for (int i = 0; i < n; i += 2) {
    const bool pair = i + 1 < n;
    const int64_t offset = static_cast<int64_t>(i) * ld;
    float row_delta[2] = {0.0f, 0.0f};
    for (int r = 0; r < (pair ? 2 : 1); ++r) {
      const int64_t at = offset + r * ld;
      row_delta[r] = probabilities_and_delta(ld, scores + at, grad_scores + at, finish.offset(at), lse[i + r]);
    }
    const __m512 delta_0 = _mm512_set1_ps(row_delta[0]), delta_1 = _mm512_set1_ps(row_delta[1]);
    c10::BFloat16* ds_row = rounded.ds_rows + static_cast<int64_t>(i) * rounded.lp;
    c10::BFloat16* ds_pairs = rounded.ds_row_pairs + static_cast<int64_t>(i) * rounded.ldb;
    c10::BFloat16* p_pairs = rounded.p_row_pairs + static_cast<int64_t>(i) * rounded.ldb;
    over_lanes(ld, [&](int j, __mmask16 lanes) {
      const int64_t at_0 = offset + j, at_1 = offset + ld + j;
      const SoftmaxLanes first =
          softmax_backward_lanes(scores + at_0, grad_scores + at_0, finish, zero, delta_0, lanes, true);
      const SoftmaxLanes second =
          pair ? softmax_backward_lanes(scores + at_1, grad_scores + at_1, finish, zero, delta_1, lanes, true)
               : SoftmaxLanes{zero, zero};
      _mm512_mask_storeu_ps(grad_scores + at_0, lanes, first.grad);
      if (pair) _mm512_mask_storeu_ps(grad_scores + at_1, lanes, second.grad);
      if (grad_sum != nullptr) {
        float* sums[2] = {grad_sum + at_0, grad_sum + at_1};
        const __m512 grads[2] = {first.grad, second.grad};
        for (int r = 0; r < (pair ? 2 : 1); ++r) {
          _mm512_mask_storeu_ps(sums[r], lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, sums[r]), grads[r]));
        }
      }
      const __m512i ds = round_to_bfloat16(first.grad, second.grad);  // the first row's, then the second's
      store_words(ds_row + j, lanes, _mm512_castsi512_si256(ds));
      if (pair) store_words(ds_row + rounded.lp + j, lanes, _mm512_extracti64x4_epi64(ds, 1));
      _mm512_mask_storeu_epi32(ds_pairs + 2 * j, lanes, _mm512_permutexvar_epi16(order, ds));
      _mm512_mask_storeu_epi32(p_pairs + 2 * j, lanes,
                               _mm512_permutexvar_epi16(order, round_to_bfloat16(first.prob, second.prob)));
    });
    for (int r = 0; r < (pair ? 2 : 1); ++r) {
      std::fill(ds_row + r * rounded.lp + ld, ds_row + (r + 1) * rounded.lp, c10::BFloat16(0));
    }
    std::fill(ds_pairs + 2 * ld, ds_pairs + 2 * rounded.ldb, c10::BFloat16(0));
    std::fill(p_pairs + 2 * ld, p_pairs + 2 * rounded.ldb, c10::BFloat16(0));
  }
}
#endif

// rows[j][0..D) = factor * column j of m (D x cols, row-major), or += where `add`, for j < cols: the products'
// transposed key or value gradients as the keys' rows, 16 x 16 at a time where the compiler targets AVX-512.
inline void columns_to_rows(float* const* rows, const float* m, int cols, int64_t D, float factor, bool add) {
  int j0 = 0;
#if VIL_AVX512
  const __m512 f = _mm512_set1_ps(factor);
  for (; j0 + 16 <= cols; j0 += 16) {
    int64_t e0 = 0;
    for (; e0 + 16 <= D; e0 += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(m + (e0 + t) * cols + j0);
      transpose_16x16(r);
      for (int t = 0; t < 16; ++t) {
        float* row = rows[j0 + t] + e0;
        const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(r[t]), f);
        _mm512_storeu_ps(row, add ? _mm512_add_ps(x, _mm512_loadu_ps(row)) : x);
      }
    }
    for (int t = 0; t < 16; ++t) {
      float* row = rows[j0 + t];
      for (int64_t e = e0; e < D; ++e) row[e] = factor * m[e * cols + j0 + t] + (add ? row[e] : 0.0f);
    }
  }
#endif
  for (int j = j0; j < cols; ++j) {
    for (int64_t e = 0; e < D; ++e) rows[j][e] = factor * m[e * cols + j] + (add ? rows[j][e] : 0.0f);
  }
}

// Where a 1D backward with half-precision products sums the key or value gradients of one residue class: transposed
// (D x the class's length, in float), as those products give them (dk^T = q^T dS), so that each block adds its span's
// columns in place; finish writes the sums, times `factor`, as the gradient's rows.
template <typename S>
struct TransposedGradientSum {
  Map<S> out{};
  std::vector<float> sums, rows;
  std::vector<float*> row_of;
  int64_t length = 0, D = 0;
  float factor = 1;

  void start(Map<S> gradient, int64_t length_, int64_t D_, float factor_) {
    out = gradient, length = length_, D = D_, factor = factor_;
    sums.assign(D * length, 0.0f);
  }
  void finish() {
    rows.resize(length * D);
    row_of.resize(length);
    for (int64_t t = 0; t < length; ++t) row_of[t] = rows.data() + t * D;
    columns_to_rows(row_of.data(), sums.data(), static_cast<int>(length), D, factor, false);
    for (int64_t t = 0; t < length; ++t) narrow_row(out.at(t, 0), row_of[t], D, 1.0f, false);
  }
};

// Whether torch's micro-kernel reads the B operands of S in pairs: bfloat16 always (AVX512-BF16 dot products and AMX
// tiles read pairs), float16 on AMX-FP16 tiles only; on AVX512-FP16 it reads them plain.
template <typename S>
bool reads_pairs() {
  if constexpr (std::is_same_v<S, c10::Half>) {
    static const bool amx_fp16 = at::native::cpublas::could_pack(at::kHalf);
    return amx_fp16;
  }
  return true;
}

// The keys and values of a call written once into the layouts the half-precision products read (B operands, see the
// writers above), sequence by sequence (`items` of them: ClassLayouts, MapLayouts): a run of consecutive keys of a
// sequence is then a range of its layouts (columns 2 k0.. of the element pairs, or k0.. plain; rows k0/2.. of the
// token pairs, k0 even), which the products read in place, where otherwise each key would be written for every block
// (chunk) that reads it. The forward reads the keys summed over their elements and the values summed over
// themselves; the backward those and the other two.
template <typename S>
struct KeyLayouts {
  // A B operand: its first element, and its row length in pairs (in elements where plain).
  struct Operand {
    const S* data;
    int ldb;
  };
  using Storage = S;
  int64_t D, Dq;
  bool pairs = reads_pairs<S>();
  std::vector<int64_t> lengths, element_offsets, token_offsets;  // per sequence
  Scratch key_elements, key_tokens, value_elements, value_tokens;

  // tokens(item, k, v): the keys and values of sequence `item` (lengths[item] of them), as pointers to D elements
  // each, into k and v.
  template <typename F>
  KeyLayouts(std::vector<int64_t> lengths_, int64_t D_, bool backward, F&& tokens)
      : D(D_), Dq(pairs_per_row(D_)), lengths(std::move(lengths_)) {
    int64_t elements = 0, all_tokens = 0;
    for (const int64_t n : lengths) {
      element_offsets.push_back(elements);
      token_offsets.push_back(all_tokens);
      elements += even(D) * pairs_per_row(n);
      all_tokens += even(n) * Dq;
    }
    const int64_t size = static_cast<int64_t>(sizeof(S));
    key_elements = Scratch(elements * size);
    (backward ? value_elements : value_tokens) = Scratch((backward ? elements : all_tokens) * size);
    if (backward) key_tokens = Scratch(all_tokens * size);
    at::parallel_for(0, static_cast<int64_t>(lengths.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<const S*> k_tokens, v_tokens;
      for (int64_t item = begin; item < end; ++item) {
        tokens(item, k_tokens, v_tokens);
        const int count = static_cast<int>(lengths[item]), ldb = pairs_per_row(count);
        const auto write_elements = pairs ? write_element_pairs<S> : write_element_columns<S>;
        const auto write_tokens = pairs ? write_token_pairs<S> : write_token_rows<S>;
        write_elements(at_elements(key_elements, item), k_tokens.data(), count, D, ldb);
        if (backward) {
          write_elements(at_elements(value_elements, item), v_tokens.data(), count, D, ldb);
          write_tokens(at_tokens(key_tokens, item), k_tokens.data(), count, D, static_cast<int>(Dq));
        } else {
          write_tokens(at_tokens(value_tokens, item), v_tokens.data(), count, D, static_cast<int>(Dq));
        }
      }
    });
  }

  S* at_elements(const Scratch& t, int64_t item) const { return t.data<S>() + element_offsets[item]; }
  S* at_tokens(const Scratch& t, int64_t item) const { return t.data<S>() + token_offsets[item]; }
  // The keys from k0 of sequence `item`, in each layout.
  Operand elements(const Scratch& t, int64_t item, int64_t k0) const {
    return {at_elements(t, item) + (pairs ? 2 : 1) * k0, pairs_per_row(lengths[item])};
  }
  Operand tokens(const Scratch& t, int64_t item, int64_t k0) const {
    return {at_tokens(t, item) + k0 * Dq, static_cast<int>(Dq)};
  }
};

// 2D: the keys and values of each map (item: batch entry * H + head) in the layouts of the half-precision products,
// chunk after chunk, row-major within a chunk, and a key of zeros after a chunk of odd size where
// Geometry::even_blocks (whose score columns are so laid out), then the G global keys: the key blocks of the slots of
// a chunk that read consecutive chunks are one run of keys, which the products read in place, where each key is read
// by up to 9 chunks (and the global keys by all).
template <typename S>
struct MapLayouts : KeyLayouts<S> {
  std::vector<int64_t> chunk_starts;  // per chunk: its first key; then the first global key

  MapLayouts(const Geometry& g, const Inputs& in, bool backward)
      : KeyLayouts<S>(std::vector<int64_t>(g.B * g.H, starts_of(g).back() + g.G), g.D, backward,
                [&, zeros = std::vector<S>(g.D, S(0))](int64_t item, std::vector<const S*>& k,
                                                       std::vector<const S*>& v) {
                  const Map<const S> keys = map_of<const S>(in.k, item / g.H, item % g.H),
                                     values = map_of<const S>(in.v, item / g.H, item % g.H);
                  k.clear();
                  v.clear();
                  for (int64_t chunk = 0; chunk < g.chunks(); ++chunk) {
                    const Tile t = tile_of(g, chunk);
                    const size_t first = k.size();
                    for (int64_t r = t.r0; r < t.r0 + t.rows; ++r) {
                      for (int64_t c = t.c0; c < t.c0 + t.cols; ++c) {
                        k.push_back(keys.at(r, c));
                        v.push_back(values.at(r, c));
                      }
                    }
                    k.resize(first + g.block_columns(t.rows * t.cols), zeros.data());
                    v.resize(k.size(), zeros.data());
                  }
                  const S* gk = head_of<S>(in.global_k, item, g.G * g.D);
                  const S* gv = head_of<S>(in.global_v, item, g.G * g.D);
                  for (int64_t j = 0; j < g.G; ++j) k.push_back(gk + j * g.D), v.push_back(gv + j * g.D);
                }),
        chunk_starts(starts_of(g)) {}

  static std::vector<int64_t> starts_of(const Geometry& g) {
    std::vector<int64_t> starts{0};
    for (int64_t chunk = 0; chunk < g.chunks(); ++chunk) {
      const Tile t = tile_of(g, chunk);
      starts.push_back(starts.back() + g.block_columns(t.rows * t.cols));
    }
    return starts;
  }

  // Calls fn(first score column, columns, first key) for each run of chunk c's slots that read consecutive chunks,
  // then for the G global keys (the score columns after the local ones).
  template <typename F>
  void for_each_run(const Chunk& c, int64_t G, F&& fn) const {
    for (int s = 0; s < c.slots;) {
      int next = s + 1;
      while (next < c.slots && c.read[next] == c.read[next - 1] + 1) ++next;
      const int end = next < c.slots ? c.start[next] : c.keys;
      fn(c.start[s], end - c.start[s], chunk_starts[c.read[s]]);
      s = next;
    }
    if (G > 0) fn(c.keys, static_cast<int>(G), chunk_starts.back());
  }
};

// The products of one chunk (block) in half precision S (bfloat16, half) with float sums, on the CPU's matrix
// instructions (half_product). q, k, v, the output's gradient, the probabilities P and the score gradients dS go into
// the layouts the products read: rows (A operands) or pairs (B operands, in rows of a multiple of 16 pairs, the
// column blocks of AMX tiles; plain rows of as many elements where the micro-kernel reads them so), see the writers
// above. The names of the B buffers say the pairs layout.
//   forward:  scores = q k^T       (q rows, k element pairs)     out = P v      (P rows, v token pairs)
//   backward: dP = dO v^T          (dO rows, v element pairs)    dq = dS k      (dS rows, k token pairs)
//             dk^T = q^T dS        (q columns, dS row pairs)     dv^T = dO^T P  (dO columns, P row pairs)
// The key and value gradients come out transposed (D x keys): added to the keys' rows column by column in 2D
// (columns_to_rows), in place to the residue class's transposed sums in 1D (TransposedGradientSum). The scale
// multiplies the scores (and dq, dk) in float, so that q is read unrounded.
template <typename S>
struct HalfProducts {
  using Compute = float;
  using Global = S;
  template <typename>
  using ClassKeys = ClassLayouts<KeyLayouts<S>>;
  template <typename>
  using MapKeys = MapLayouts<S>;
  static constexpr bool kReadsMapLayouts = true;
  using Operand = typename KeyLayouts<S>::Operand;
  int64_t D, Dp;          // head dim, rounded up to even
  int Dq;                 // pairs per row of the token pairs (D rounded up to 16)
  int n = 0, np = 0;      // queries, rounded up to even
  int ld = 0, lp = 0;     // score row length (local keys + G); row length of P and dS as A operands (below)
  int lq = 0;             // pairs per row of the element and row pairs (ld rounded up to 16)
  int local = 0, lg = 0;  // columns of the local keys' operands (below); where the global keys' begin in P and dS
  float score_scale = 0;  // scale * log2(e)
  bool pairs = reads_pairs<S>();
  std::vector<const S*> query_tokens, key_tokens, value_tokens, grad_out_tokens;
  std::vector<S> q_rows, q_columns, k_element_pairs, k_token_pairs, v_element_pairs, v_token_pairs;
  std::vector<S> grad_out_rows, grad_out_columns, p_rows, p_row_pairs, ds_rows, ds_row_pairs;
  std::vector<float> scores, grad_scores, result, transposed, row_max, total;
  std::vector<float*> sum_rows;  // where each key's gradient is added (add_window_gradients; 1D: the global keys')
  std::vector<float> masked_sums;  // where the gradients of the masked columns of even_blocks are added (zeros)
  // The first `local` score columns read the keys and values of the layouts (2D: MapLayouts, 1D: ClassLayouts), in
  // runs of columns whose keys are consecutive there (2D: the key blocks of slots that read consecutive chunks, then
  // the global keys: all ld columns; 1D: the block's span), and in 1D the G global keys after them are read from the
  // buffers above, multiplied apart. P and dS rows (lp long) hold the local columns, a zero where their count is odd
  // and global keys follow, then the global columns from lg.
  struct Run {
    int column, length;
    Operand k_elements, k_tokens, v_elements, v_tokens;  // B operands
  };
  std::vector<Run> runs;

  HalfProducts(int64_t S_, int64_t L, int64_t D_)
      : D(D_), Dp(even(D_)), Dq(pairs_per_row(D_)), q_rows(S_ * Dp), q_columns(D_ * even(S_)), grad_out_rows(S_ * Dp),
        grad_out_columns(D_ * even(S_)), p_rows(S_ * (even(L) + 2)), p_row_pairs(even(S_) * pairs_per_row(L)),
        ds_rows(S_ * (even(L) + 2)), ds_row_pairs(even(S_) * pairs_per_row(L)), scores(S_ * L), grad_scores(S_ * L),
        result(std::max(S_, L) * D_), transposed(L * D_), row_max(S_), total(S_), masked_sums(D_) {}

  // 2D: the chunk's queries into the buffers; the key blocks of its slots and the global keys from `layouts` (map
  // `item`: batch entry * H + head), a run for each set of slots that read consecutive chunks and one for the global
  // keys.
  void load_chunk(const Window& win, const Chunk& c, const MapKeys<S>& layouts, int64_t item, Map<const S> q,
                  Map<const S> /*k*/, Map<const S> /*v*/, const S* /*gk*/, const S* /*gv*/, int64_t G, int64_t /*D*/,
                  double scale, bool backward) {
    const int keys = c.keys + static_cast<int>(G);
    load_queries(win, q, keys, keys, scale, backward);
    runs.clear();
    layouts.for_each_run(c, G, [&](int column, int length, int64_t k0) {
      runs.push_back(run_of(layouts, item, column, length, k0, backward));
    });
  }

  // 1D: the block's queries and global keys and values into the buffers; its span of keys from `layouts` (class
  // `item`: batch entry * classes + run).
  void load_span(const Window& win, const Block& blk, const ClassKeys<S>& layouts, int64_t item, Map<const S> q,
                 const S* gk, const S* gv, int64_t G, int64_t /*D*/, double scale, bool backward) {
    load_queries(win, q, blk.keys, blk.keys + static_cast<int>(G), scale, backward);
    load_globals(gk, gv, G, backward);
    runs.assign(1, run_of(layouts, item, 0, blk.keys, blk.k0, backward));
  }

  // The run of `length` score columns from `column` that read keys k0.. of sequence `item` of `layouts` (k0 even).
  static Run run_of(const KeyLayouts<S>& layouts, int64_t item, int column, int length, int64_t k0, bool backward) {
    Run run{column, length, layouts.elements(layouts.key_elements, item, k0), {}, {}, {}};
    if (backward) {
      run.k_tokens = layouts.tokens(layouts.key_tokens, item, k0);
      run.v_elements = layouts.elements(layouts.value_elements, item, k0);
    } else {
      run.v_tokens = layouts.tokens(layouts.value_tokens, item, k0);
    }
    return run;
  }

  // The G global keys and values into the buffers.
  void load_globals(const S* gk, const S* gv, int64_t G, bool backward) {
    key_tokens.resize(G);
    value_tokens.resize(G);
    for (int64_t j = 0; j < G; ++j) key_tokens[j] = gk + j * D, value_tokens[j] = gv + j * D;
    write_keys(backward);
  }

  // The sizes of a chunk (block) of `ld` keys whose first `local` columns the local operands hold, and the queries'
  // layouts.
  void load_queries(const Window& win, Map<const S> q, int local_, int ld_, double scale, bool backward) {
    n = static_cast<int>(win.queries.size()), np = static_cast<int>(even(n));
    local = local_, ld = ld_, lq = pairs_per_row(ld);
    lg = ld > local ? static_cast<int>(even(local)) : local;
    lp = static_cast<int>(even(lg + ld - local));
    score_scale = static_cast<float>(scale * kLog2e);
    query_tokens.resize(n);
    for (int i = 0; i < n; ++i) query_tokens[i] = q.at(win.queries[i]);
    write_rows(q_rows.data(), query_tokens.data(), n, D, Dp);
    if (backward) write_columns(q_columns.data(), query_tokens.data(), n, np, D);
  }

  // The keys and values of key_tokens and value_tokens (a 1D block's G global ones) into the buffers the products
  // read, sized as they are written: summed over their elements (Dp x the keys), or over themselves (the keys x D).
  void write_keys(bool backward) {
    const int count = static_cast<int>(key_tokens.size()), ldb = pairs_per_row(count);
    const auto over_elements = [&](std::vector<S>& dst, const std::vector<const S*>& tokens) {
      dst.resize(Dp * ldb);
      (pairs ? write_element_pairs<S> : write_element_columns<S>)(dst.data(), tokens.data(), count, D, ldb);
    };
    const auto over_tokens = [&](std::vector<S>& dst, const std::vector<const S*>& tokens) {
      dst.resize(even(count) * Dq);
      (pairs ? write_token_pairs<S> : write_token_rows<S>)(dst.data(), tokens.data(), count, D, Dq);
    };
    over_elements(k_element_pairs, key_tokens);
    if (backward) {
      over_tokens(k_token_pairs, key_tokens);
      over_elements(v_element_pairs, value_tokens);
    } else {
      over_tokens(v_token_pairs, value_tokens);
    }
  }

  // out (n x ld) = rows (n x Dp: q or dO) times the keys' (or values') elements: each run's operand `local_keys`,
  // then the global keys' buffer.
  void multiply_elements(const S* rows, Operand Run::*local_keys, const S* global_keys, float* out) const {
    const int Di = static_cast<int>(Dp);
    for (const Run& run : runs) {
      const Operand keys = run.*local_keys;
      half_product(n, run.length, Di, rows, Di, keys.data, keys.ldb, out + run.column, ld);
    }
    half_product(n, ld - local, Di, rows, Di, global_keys, pairs_per_row(ld - local), out + local, ld);
  }

  // out (n x D) = rows (n x lp: P or dS) times the keys (or values): each run's operand `local_keys`, then the global
  // keys' buffer; zeros where there are no keys.
  void multiply_tokens(const S* rows, Operand Run::*local_keys, const S* global_keys, float* out) const {
    const int Di = static_cast<int>(D);
    for (size_t i = 0; i < runs.size(); ++i) {
      const Operand keys = runs[i].*local_keys;
      half_product(n, Di, static_cast<int>(even(runs[i].length)), rows + runs[i].column, lp, keys.data, keys.ldb, out,
                   Di, i > 0);
    }
    half_product(n, Di, static_cast<int>(even(ld - local)), rows + lg, lp, global_keys, Dq, out, Di, !runs.empty());
    if (runs.empty() && ld == local) std::fill(out, out + static_cast<int64_t>(n) * D, 0.0f);
  }

  // Moves the global columns of n rows of P or dS (written as ld columns of lp) to lg, after the zero that pads the
  // local columns to even.
  void place_global_columns(S* rows) const {
    if (lg == local) return;
    for (int i = 0; i < n; ++i) {
      S* row = rows + static_cast<int64_t>(i) * lp;
      std::memmove(row + lg, row + local, static_cast<size_t>(ld - local) * sizeof(S));
      row[local] = S(0);
    }
  }

  // The products of the queries and keys, to be multiplied by score_factor().
  float* multiply_scores(int /*n*/, int64_t /*D*/) {
    multiply_elements(q_rows.data(), &Run::k_elements, k_element_pairs.data(), scores.data());
    return scores.data();
  }
  float score_factor() const { return score_scale; }

  const float* attend(int /*n*/, int64_t /*D*/, const Finish<float>& finish) {
    exponentiate_rows(scores.data(), n, ld, ld, finish, p_rows.data(), lp, row_max.data(), total.data());
    for (int i = 0; i < n; ++i) std::fill(p_rows.data() + i * lp + ld, p_rows.data() + (i + 1) * lp, S(0));
    place_global_columns(p_rows.data());
    multiply_tokens(p_rows.data(), &Run::v_tokens, v_token_pairs.data(), result.data());
    return result.data();
  }

  // The output is not read: delta comes from the rows (see softmax_backward).
  void load_grad_out(const Window& win, Map<const S> grad_out, Map<const S> /*out*/, int64_t /*D*/) {
    grad_out_tokens.resize(n);
    for (int i = 0; i < n; ++i) grad_out_tokens[i] = grad_out.at(win.queries[i]);
    write_rows(grad_out_rows.data(), grad_out_tokens.data(), n, D, Dp);
    write_columns(grad_out_columns.data(), grad_out_tokens.data(), n, np, D);
  }

  void differentiate(int /*n*/, int64_t /*D*/, const float* lse, const Finish<float>& finish, float* grad_sum) {
    multiply_elements(grad_out_rows.data(), &Run::v_elements, v_element_pairs.data(), grad_scores.data());
    softmax_backward(n, ld, scores.data(), grad_scores.data(), lse, finish, grad_sum,
                     RoundedSoftmax<S>{ds_rows.data(), ds_row_pairs.data(), p_row_pairs.data(), lp, lq, pairs});
    place_global_columns(ds_rows.data());
  }

  const float* grad_queries(int /*n*/, int64_t /*D*/, double scale) {
    multiply_tokens(ds_rows.data(), &Run::k_tokens, k_token_pairs.data(), result.data());
    const float factor = static_cast<float>(scale);
    for (int64_t i = 0; i < n * D; ++i) result[i] *= factor;
    return result.data();
  }
  // Adds the key (or value) gradients of score columns first.. first + count, columns^T times those columns of
  // row_pairs (D x count, one column per key), times `factor`, to the rows sum_rows[0..count) (columns_to_rows).
  void add_transposed_gradients(const S* columns, const S* row_pairs, int first, int count, float factor) {
    const int64_t column = (pairs ? 2 : 1) * static_cast<int64_t>(first);
    half_product(static_cast<int>(D), count, np, columns, np, row_pairs + column, lq, transposed.data(), count);
    columns_to_rows(sum_rows.data(), transposed.data(), count, D, factor, true);
  }

  // 2D: adds the gradients of the window's keys and values to the map's sums (dk, dv: the local keys, at win.keys)
  // and to global_k and global_v (G x D), from the products' D x ld results as they are (columns_to_rows).
  void add_window_gradients(int /*n*/, int64_t /*D*/, const Window& win, double scale, Map<float> dk, Map<float> dv,
                            float* global_k, float* global_v) {
    const int keys = static_cast<int>(win.keys.size());
    auto add = [&](float factor, const S* columns, const S* row_pairs, Map<float> sum, float* global) {
      sum_rows.resize(ld);
      for (int j = 0; j < ld; ++j) {
        const bool masked = j < keys && win.keys[j].row == kMaskedKey.row;
        sum_rows[j] = j >= keys ? global + (j - keys) * D : masked ? masked_sums.data() : sum.at(win.keys[j]);
      }
      add_transposed_gradients(columns, row_pairs, 0, ld, factor);
    };
    add(static_cast<float>(scale), q_columns.data(), ds_row_pairs.data(), dk, global_k);
    add(1.0f, grad_out_columns.data(), p_row_pairs.data(), dv, global_v);
  }

  // 1D: the key and value gradients of one residue class, transposed as the products give them (a template, as
  // FloatProducts' is, which takes the storage type from the caller).
  template <typename>
  struct ClassGradients {
    TransposedGradientSum<S> keys, values;
    void start(Map<S> grad_k, Map<S> grad_v, int64_t length, int64_t D, double scale) {
      keys.start(grad_k, length, D, static_cast<float>(scale));
      values.start(grad_v, length, D, 1.0f);
    }
    void finish() {
      keys.finish();
      values.finish();
    }
  };

  // 1D: adds the gradients of the block's span of keys and values (from key k0 of its class) to the class's sums,
  // and those of the global keys and values to global_k and global_v (G x D, in float).
  void add_key_value_gradients(int /*n*/, int64_t /*D*/, int64_t k0, ClassGradients<S>& sums, float* global_k,
                               float* global_v) {
    const int Di = static_cast<int>(D), G = ld - local;
    half_product(Di, local, np, q_columns.data(), np, ds_row_pairs.data(), lq, sums.keys.sums.data() + k0,
                 static_cast<int>(sums.keys.length), true);
    half_product(Di, local, np, grad_out_columns.data(), np, p_row_pairs.data(), lq, sums.values.sums.data() + k0,
                 static_cast<int>(sums.values.length), true);
    if (G == 0) return;
    auto add_global = [&](const S* columns, const S* row_pairs, float factor, float* global) {
      sum_rows.resize(G);
      for (int j = 0; j < G; ++j) sum_rows[j] = global + j * D;
      add_transposed_gradients(columns, row_pairs, local, G, factor);
    };
    add_global(q_columns.data(), ds_row_pairs.data(), sums.keys.factor, global_k);
    add_global(grad_out_columns.data(), p_row_pairs.data(), 1.0f, global_v);
  }

  // Gives back what the micro-kernel holds on this thread (AMX's tile configuration).
  static void release() { at::native::cpublas::brgemm_release(true); }
};

// The geometry as the products of W read the keys: Geometry::even_blocks where they read MapLayouts.
template <typename W>
Geometry read_by(Geometry g) {
  g.even_blocks = W::kReadsMapLayouts;
  return g;
}

template <typename S, typename W>
void forward_impl(const Geometry& map, const Inputs& in, const int64_t* slot_table, at::Tensor& out, at::Tensor& lse,
                  double scale) {
  using T = typename W::Compute;
  using Global = typename W::Global;
  const Geometry g = read_by<W>(map);
  const int64_t C = g.chunks(), table = g.bias_rows();
  const auto recent = recent_chunk_biases<T>(g, slot_table, in.rel_bias, in.global_bias);
  const ChunkBiases<T>& biases = *recent;
  const typename W::template MapKeys<S> layouts(g, in, false);
  at::parallel_for(0, g.B * g.H * C, 1, [&](int64_t begin, int64_t end) {
    W ws(g.max_queries(), g.max_keys(), g.D);
    Window win;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / C, b = bh / g.H, h = bh % g.H, chunk = item % C;
      const Chunk c = make_chunk(g, slot_table, chunk);
      set_window(c, win, !W::kReadsMapLayouts);
      ws.load_chunk(win, c, layouts, bh, map_of<const S>(in.q, b, h), map_of<const S>(in.k, b, h),
                    map_of<const S>(in.v, b, h), head_of<Global>(in.global_k, bh, g.G * g.D),
                    head_of<Global>(in.global_v, bh, g.G * g.D), g.G, g.D, scale, false);
      const Finish<T> finish =
          finish_scores(g, c, chunk, h, biases, ws.multiply_scores(c.queries(), g.D), ws.ld, ws.score_factor(),
                        head_of<T>(in.rel_bias, h, table), head_of<T>(in.global_bias, h, g.G));
      const T* o = ws.attend(c.queries(), g.D, finish);
      const Map<S> out_map = map_of<S>(out, b, h);
      T* lse_map = lse.data_ptr<T>() + bh * g.X * g.Y;
      for (int i = 0; i < c.queries(); ++i) {
        const Position p = win.queries[i];
        store_output(out_map.at(p), lse_map + p.row * g.Y + p.col, o + i * g.D, g.D, ws.row_max[i], ws.total[i]);
      }
    }
    W::release();
  });
}

template <typename S, typename W>
void backward_impl(const Geometry& map, const Inputs& in, const int64_t* slot_table, const at::Tensor& out,
                   const at::Tensor& grad_out, const at::Tensor& lse, Gradients& grad, double scale) {
  using T = typename W::Compute;
  using Global = typename W::Global;
  const Geometry g = read_by<W>(map);
  const int64_t C = g.chunks(), table = g.bias_rows();
  const auto recent = recent_chunk_biases<T>(g, slot_table, in.rel_bias, in.global_bias);
  const ChunkBiases<T>& biases = *recent;
  const typename W::template MapKeys<S> layouts(g, in, true);
  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
    W ws(g.max_queries(), g.max_keys(), g.D);
    Window win;
    std::vector<T> lse_rows(g.max_queries());
    std::vector<std::vector<T>> kind_grads(biases.sample.size());  // the score gradients of each kind, summed
    GradientSum<S, T> sum_k, sum_v;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.H, h = bh % g.H;
      const Map<const S> q_map = map_of<const S>(in.q, b, h), k_map = map_of<const S>(in.k, b, h),
                         v_map = map_of<const S>(in.v, b, h), out_map = map_of<const S>(out, b, h),
                         grad_out_map = map_of<const S>(grad_out, b, h);
      const T* rel = head_of<T>(in.rel_bias, h, table);
      const T* glob = head_of<T>(in.global_bias, h, g.G);
      T* grad_rel = grad_of<T>(grad.rel_bias, bh, table);
      T* grad_glob = grad_of<T>(grad.global_bias, bh, g.G);
      const bool bias_gradients = grad_rel != nullptr || grad_glob != nullptr;
      const T* lse_map = lse.data_ptr<T>() + bh * g.X * g.Y;
      sum_k.start(map_of<S>(grad.k, b, h), g.X, g.Y, g.D);
      sum_v.start(map_of<S>(grad.v, b, h), g.X, g.Y, g.D);
      if (biases.dense && bias_gradients) {
        for (size_t kind = 0; kind < kind_grads.size(); ++kind) kind_grads[kind].assign(biases.size(kind), T(0));
      }
      for (int64_t chunk = 0; chunk < C; ++chunk) {
        const Chunk c = make_chunk(g, slot_table, chunk);
        const int n = c.queries();
        set_window(c, win, true);
        ws.load_chunk(win, c, layouts, bh, q_map, k_map, v_map, head_of<Global>(in.global_k, bh, g.G * g.D),
                      head_of<Global>(in.global_v, bh, g.G * g.D), g.G, g.D, scale, true);
        const Finish<T> finish =
            finish_scores(g, c, chunk, h, biases, ws.multiply_scores(n, g.D), ws.ld, ws.score_factor(), rel, glob);
        ws.load_grad_out(win, grad_out_map, out_map, g.D);
        for (int i = 0; i < n; ++i) lse_rows[i] = lse_map[win.queries[i].row * g.Y + win.queries[i].col];
        const bool kind_sums = biases.dense && bias_gradients;  // else added to the bias gradients chunk by chunk
        T* grad_sum = kind_sums ? kind_grads[biases.kind_of[chunk]].data() : nullptr;
        ws.differentiate(n, g.D, lse_rows.data(), finish, grad_sum);
        if (bias_gradients && !kind_sums) add_bias_gradients(g, c, ws.grad_scores.data(), ws.ld, grad_rel, grad_glob);
        // Written in place: every query belongs to one chunk.
        scatter(map_of<S>(grad.q, b, h), win.queries, g.D, ws.grad_queries(n, g.D, scale), false);
        T* global_k = grad.global_k.data_ptr<T>() + bh * g.G * g.D;
        T* global_v = grad.global_v.data_ptr<T>() + bh * g.G * g.D;
        ws.add_window_gradients(n, g.D, win, scale, sum_k.target, sum_v.target, global_k, global_v);
      }
      sum_k.finish();
      sum_v.finish();
      if (biases.dense && bias_gradients) {
        for (size_t kind = 0; kind < kind_grads.size(); ++kind) {
          const Chunk c = make_chunk(g, slot_table, biases.sample[kind]);
          add_bias_gradients(g, c, kind_grads[kind].data(), c.keys + static_cast<int>(g.G), grad_rel, grad_glob);
        }
      }
    }
    W::release();
  });
}

template <typename S, typename W>
void forward_1d_impl(const Geometry1d& g, const Inputs& in, const at::Tensor& key_padding_mask, at::Tensor& out,
                     at::Tensor& lse, double scale) {
  using T = typename W::Compute;
  using Global = typename W::Global;
  std::vector<int64_t> runs;
  const std::vector<Block> blocks = make_blocks(g, runs);
  const int64_t n = static_cast<int64_t>(blocks.size()), bias_rows = g.bias_rows(),
                classes = static_cast<int64_t>(runs.size()) - 1;
  const typename W::template ClassKeys<S> layouts(g, in, runs, blocks, false);
  at::parallel_for(0, g.B * n, 1, [&](int64_t begin, int64_t end) {
    W ws(g.max_queries(), g.max_keys(), g.D);
    Window win;
    std::vector<T> key_mask(g.span());
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n;
      const Block& blk = blocks[item % n];
      const int64_t bh = b * g.H + blk.h;
      set_window(blk, win);
      ws.load_span(win, blk, layouts, b * classes + blk.run, map_of<const S>(in.q, b, blk.h).every(blk.r, blk.d),
                   head_of<Global>(in.global_k, bh, g.G * g.D), head_of<Global>(in.global_v, bh, g.G * g.D), g.G, g.D,
                   scale, false);
      const Finish<T> finish = finish_scores(g, blk, ws.multiply_scores(blk.queries, g.D), ws.ld, ws.score_factor(),
                                             head_of<T>(in.rel_bias, blk.h, bias_rows),
                                             head_of<T>(in.global_bias, blk.h, g.G),
                                             head_of<bool>(key_padding_mask, b, g.L), key_mask.data());
      const T* o = ws.attend(blk.queries, g.D, finish);
      const Map<S> out_class = map_of<S>(out, b, blk.h).every(blk.r, blk.d);
      T* lse_seq = lse.data_ptr<T>() + bh * g.L;
      for (int i = 0; i < blk.queries; ++i) {
        const int64_t t = blk.t0 + i;
        store_output(out_class.at(t, 0), lse_seq + blk.r + blk.d * t, o + i * g.D, g.D, ws.row_max[i], ws.total[i]);
      }
    }
    W::release();
  });
}

// The global key, value and bias gradients are partial sums per (batch, head, residue class), added up by the
// caller, so that the residue classes of one head can run on different threads.
template <typename S, typename W>
void backward_1d_impl(const Geometry1d& g, const Inputs& in, const at::Tensor& key_padding_mask, const at::Tensor& out,
                      const at::Tensor& grad_out, const at::Tensor& lse, Gradients& grad, double scale) {
  using T = typename W::Compute;
  using Global = typename W::Global;
  std::vector<int64_t> runs;
  const std::vector<Block> blocks = make_blocks(g, runs);
  const int64_t classes = static_cast<int64_t>(runs.size()) - 1, bias_rows = g.bias_rows();
  const typename W::template ClassKeys<S> layouts(g, in, runs, blocks, true);
  at::parallel_for(0, g.B * classes, 1, [&](int64_t begin, int64_t end) {
    W ws(g.max_queries(), g.max_keys(), g.D);
    Window win;
    std::vector<T> lse_rows(g.block), key_mask(g.span());
    typename W::template ClassGradients<S> sums;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / classes, run = item % classes;
      const Block& first = blocks[runs[run]];
      const int64_t h = first.h, r = first.r, d = first.d, bh = b * g.H + h, partial = bh * g.residues + r;
      const Map<const S> q_class = map_of<const S>(in.q, b, h).every(r, d),
                         out_class = map_of<const S>(out, b, h).every(r, d),
                         grad_out_class = map_of<const S>(grad_out, b, h).every(r, d);
      const T* rel = head_of<T>(in.rel_bias, h, bias_rows);
      const T* glob = head_of<T>(in.global_bias, h, g.G);
      const T* lse_seq = lse.data_ptr<T>() + bh * g.L;
      const bool* key_padding = head_of<bool>(key_padding_mask, b, g.L);
      T* grad_rel = grad_of<T>(grad.rel_bias, partial, bias_rows);
      T* grad_glob = grad_of<T>(grad.global_bias, partial, g.G);
      const int64_t length = g.class_length(r, d);
      sums.start(map_of<S>(grad.k, b, h).every(r, d), map_of<S>(grad.v, b, h).every(r, d), length, g.D, scale);
      for (int64_t index = runs[run]; index < runs[run + 1]; ++index) {
        const Block& blk = blocks[index];
        const int n = blk.queries;
        set_window(blk, win);
        ws.load_span(win, blk, layouts, item, q_class, head_of<Global>(in.global_k, bh, g.G * g.D),
                     head_of<Global>(in.global_v, bh, g.G * g.D), g.G, g.D, scale, true);
        const Finish<T> finish = finish_scores(g, blk, ws.multiply_scores(n, g.D), ws.ld, ws.score_factor(), rel,
                                               glob, key_padding, key_mask.data());
        ws.load_grad_out(win, grad_out_class, out_class, g.D);
        for (int i = 0; i < n; ++i) lse_rows[i] = lse_seq[r + d * (blk.t0 + i)];
        ws.differentiate(n, g.D, lse_rows.data(), finish, nullptr);
        for (int i = 0; i < n; ++i) {
          const T* row = ws.grad_scores.data() + static_cast<int64_t>(i) * ws.ld;
          if (grad_rel != nullptr) {
            const Band band = band_of(g, blk, i);
            T* bias = grad_rel + band.bias_row;
            for (int j = band.lo; j < band.hi; ++j) bias[j - band.lo] += row[j];
          }
          if (grad_glob != nullptr) add_into(grad_glob, row + blk.keys, g.G);
        }
        // Written in place: every query belongs to one block.
        scatter(map_of<S>(grad.q, b, h).every(r, d), win.queries, g.D, ws.grad_queries(n, g.D, scale), false);
        ws.add_key_value_gradients(n, g.D, blk.k0, sums, grad.global_k.data_ptr<T>() + partial * g.G * g.D,
                                   grad.global_v.data_ptr<T>() + partial * g.G * g.D);
      }
      sums.finish();
    }
    W::release();
  });
}

// Each check raises with one sentence that names the tensor or number and what the kernels take instead.
using Named = std::pair<const char*, const at::Tensor*>;

at::ScalarType compute_type(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

bool is_half(const at::Tensor& q) { return q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf; }

void check_dtype(const at::Tensor& q) {
  TORCH_CHECK(is_half(q) || q.scalar_type() == compute_type(q),
              "local_attention_cpu: q must be float32, float64, bfloat16 or float16, got ", q.scalar_type(), ".");
}

// q's shape and dtype, and the elements of each token contiguous (the other dimensions as they come): what the
// kernels read and write of q, k, v, the output and their gradients.
void check_tokens(const at::Tensor& q, std::initializer_list<Named> tensors) {
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t->sizes() == q.sizes() && t->scalar_type() == q.scalar_type(), "local_attention_cpu: ", name,
                " must have q's shape ", q.sizes(), " and dtype ", q.scalar_type(), ", got shape ", t->sizes(),
                " and dtype ", t->scalar_type(), ".");
    TORCH_CHECK(t->size(-1) <= 1 || t->stride(-1) == 1, "local_attention_cpu: ", name,
                " must have unit stride along head_dim, got strides ", t->strides(), ".");
  }
}

// A contiguous tensor of `dtype` and `shape`: the global keys and values, the bias tables, the log-sum-exp and the
// gradient sums of the global keys, values and biases. An absent input (`optional`) is an empty tensor instead.
void check_table(const char* name, const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype,
                 bool optional = false) {
  if (optional && t.numel() == 0) return;
  TORCH_CHECK(t.sizes() == shape, "local_attention_cpu: ", name, " must have shape ", shape,
              optional ? " (or be empty)" : "", ", got ", t.sizes(), ".");
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dtype, "local_attention_cpu: ", name, " must be a contiguous ",
              dtype, " tensor, got ", t.scalar_type(), " with strides ", t.strides(), ".");
}

// What every entry point checks: q's dtype; q, k, v and the others of `tokens` (check_tokens); the global keys and
// values (B, H, G, D) in the compute type, or in q's with half-precision products; the bias tables (H,
// `bias_rows`) and (H, G), or empty; the log-sum-exp, one value per query, in the compute type.
void check_inputs(const Inputs& in, std::initializer_list<Named> tokens, const at::Tensor& lse, int64_t bias_rows,
                  bool half_products) {
  const at::Tensor& q = in.q;
  check_dtype(q);
  check_tokens(q, tokens);
  TORCH_CHECK(!half_products || is_half(q),
              "local_attention_cpu: half_products takes bfloat16 or float16 inputs, got ", q.scalar_type(), ".");
  const int64_t B = q.size(0), H = q.size(1), G = in.global_k.size(2), D = q.size(-1);
  const at::ScalarType compute = compute_type(q), global = half_products ? q.scalar_type() : compute;
  check_table("global_k", in.global_k, {B, H, G, D}, global);
  check_table("global_v", in.global_v, {B, H, G, D}, global);
  check_table("rel_bias", in.rel_bias, {H, bias_rows}, compute, true);
  check_table("global_bias", in.global_bias, {H, G}, compute, true);
  check_table("lse", lse, q.sizes().slice(0, q.dim() - 1), compute);
}

// The sums the backward adds the gradients of the global keys, values and bias tables into, in the compute type:
// per `parts` (B, H, and in 1D the residue classes), the shape of the input per head.
void check_gradient_sums(const Inputs& in, const Gradients& grad, std::vector<int64_t> parts, int64_t bias_rows) {
  const int64_t G = in.global_k.size(2), D = in.q.size(-1);
  const at::ScalarType compute = compute_type(in.q);
  auto per_part = [&parts](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> shape(parts);
    shape.insert(shape.end(), tail);
    return shape;
  };
  check_table("grad_global_k", grad.global_k, per_part({G, D}), compute);
  check_table("grad_global_v", grad.global_v, per_part({G, D}), compute);
  check_table("grad_rel_bias", grad.rel_bias, per_part({bias_rows}), compute, true);
  check_table("grad_global_bias", grad.global_bias, per_part({G}), compute, true);
}

// The dimensions of q and of the global keys, and the window: what the geometry is made of.
void check_dims(const at::Tensor& q, const at::Tensor& gk, int64_t dims, const char* q_shape, int64_t window) {
  TORCH_CHECK(q.dim() == dims, "local_attention_cpu: q must have shape ", q_shape, ", got ", q.sizes(), ".");
  TORCH_CHECK(gk.dim() == 4, "local_attention_cpu: global_k must have shape (B, H, G, D), got ", gk.sizes(), ".");
  TORCH_CHECK(window >= 1, "local_attention_cpu: window must be at least 1, got ", window, ".");
}

Geometry make_geometry(const at::Tensor& q, const at::Tensor& gk, const at::Tensor& slots, int64_t window,
                       int64_t exact) {
  check_dims(q, gk, 5, "(B, H, X, Y, D)", window);
  TORCH_CHECK(exact >= -1 && exact <= 1, "local_attention_cpu: exact must be -1, 0 or 1, got ", exact, ".");
  Geometry g;
  g.B = q.size(0), g.H = q.size(1), g.X = q.size(2), g.Y = q.size(3), g.D = q.size(4), g.G = gk.size(2);
  g.w = static_cast<int>(window), g.exact = static_cast<int>(exact);
  g.chunk_cols = static_cast<int>((g.Y + g.w - 1) / g.w);
  const int64_t chunks = g.chunks();
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == chunks && slots.size(1) <= kMaxSlots && slots.size(2) == 3 &&
                  slots.is_contiguous() && slots.scalar_type() == at::kLong,
              "local_attention_cpu: slots must be a contiguous Long tensor of shape (", chunks, ", at most ",
              kMaxSlots, ", 3), got a ", slots.scalar_type(), " tensor of shape ", slots.sizes(), ".");
  const int64_t* rows = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); i += 3) {
    TORCH_CHECK(rows[i] >= -1 && rows[i] < chunks && std::abs(rows[i + 1]) <= 1 && std::abs(rows[i + 2]) <= 1,
                "local_attention_cpu: slots holds the row (", rows[i], ", ", rows[i + 1], ", ", rows[i + 2],
                "), but each row must be a chunk in -1..", chunks - 1, " and an offset (a, b) in -1..1.");
  }
  g.num_slots = static_cast<int>(slots.size(1));
  return g;
}

Geometry1d make_geometry_1d(const at::Tensor& q, const at::Tensor& gk, const at::Tensor& key_padding_mask,
                            at::IntArrayRef dilations, int64_t window, bool causal, int64_t block) {
  check_dims(q, gk, 4, "(B, H, L, D)", window);
  TORCH_CHECK(static_cast<int64_t>(dilations.size()) == q.size(1), "local_attention_cpu: dilations must hold one ",
              "int per head (", q.size(1), "), got ", dilations.size(), ".");
  for (const int64_t d : dilations) {
    TORCH_CHECK(d >= 1, "local_attention_cpu: dilations must be at least 1, got ", dilations, ".");
  }
  TORCH_CHECK(block >= 1, "local_attention_cpu: block must be at least 1, got ", block, ".");
  check_table("key_padding_mask", key_padding_mask, {q.size(0), q.size(2)}, at::kBool, true);
  Geometry1d g;
  g.B = q.size(0), g.H = q.size(1), g.L = q.size(2), g.D = q.size(3), g.G = gk.size(2);
  g.w = static_cast<int>(window), g.block = static_cast<int>(block), g.causal = causal;
  g.dilations.assign(dilations.begin(), dilations.end());
  g.residues = 0;
  for (const int64_t d : g.dilations) g.residues = std::max(g.residues, std::min(d, g.L));
  return g;
}

// Calls fn with a value of the storage type of q and a null pointer to the products' type: half-precision products
// for bfloat16 and half where asked (half_products), else products in the compute type.
template <typename F>
void dispatch(const at::Tensor& q, bool half_products, F&& fn) {
  switch (q.scalar_type()) {
    case at::kFloat: return fn(float{}, static_cast<FloatProducts<float>*>(nullptr));
    case at::kDouble: return fn(double{}, static_cast<FloatProducts<double>*>(nullptr));
    case at::kBFloat16:
      if (half_products) return fn(c10::BFloat16{}, static_cast<HalfProducts<c10::BFloat16>*>(nullptr));
      return fn(c10::BFloat16{}, static_cast<FloatProducts<float>*>(nullptr));
    case at::kHalf:
      if (half_products) return fn(c10::Half{}, static_cast<HalfProducts<c10::Half>*>(nullptr));
      return fn(c10::Half{}, static_cast<FloatProducts<float>*>(nullptr));
    default: check_dtype(q);
  }
}

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
             const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
             const at::Tensor& slots, at::Tensor out, at::Tensor lse, int64_t window, int64_t exact, double scale,
             bool half_products) {
  const Geometry g = make_geometry(q, gk, slots, window, exact);
  const Inputs in{q, k, v, gk, gv, rel_bias, global_bias};
  check_inputs(in, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, lse, g.bias_rows(), half_products);
  dispatch(q, half_products, [&](auto s, auto* w) {
    using S = decltype(s);
    using W = std::remove_pointer_t<decltype(w)>;
    forward_impl<S, W>(g, in, slots.data_ptr<int64_t>(), out, lse, scale);
  });
}

void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
              const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
              const at::Tensor& slots, const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& lse,
              at::Tensor grad_q, at::Tensor grad_k, at::Tensor grad_v, at::Tensor grad_gk, at::Tensor grad_gv,
              at::Tensor grad_rel_bias, at::Tensor grad_global_bias, int64_t window, int64_t exact, double scale,
              bool half_products) {
  const Geometry g = make_geometry(q, gk, slots, window, exact);
  const Inputs in{q, k, v, gk, gv, rel_bias, global_bias};
  Gradients grad{grad_q, grad_k, grad_v, grad_gk, grad_gv, grad_rel_bias, grad_global_bias};
  check_inputs(in,
               {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"grad_out", &grad_out}, {"grad_q", &grad_q},
                {"grad_k", &grad_k}, {"grad_v", &grad_v}},
               lse, g.bias_rows(), half_products);
  check_gradient_sums(in, grad, {g.B, g.H}, g.bias_rows());
  dispatch(q, half_products, [&](auto s, auto* w) {
    using S = decltype(s);
    using W = std::remove_pointer_t<decltype(w)>;
    backward_impl<S, W>(g, in, slots.data_ptr<int64_t>(), out, grad_out, lse, grad, scale);
  });
}

void forward_1d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
                const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
                const at::Tensor& key_padding_mask, at::Tensor out, at::Tensor lse, at::IntArrayRef dilations,
                int64_t window, bool causal, int64_t block, double scale, bool half_products) {
  const Geometry1d g = make_geometry_1d(q, gk, key_padding_mask, dilations, window, causal, block);
  const Inputs in{q, k, v, gk, gv, rel_bias, global_bias};
  check_inputs(in, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, lse, g.bias_rows(), half_products);
  dispatch(q, half_products, [&](auto s, auto* w) {
    using S = decltype(s);
    using W = std::remove_pointer_t<decltype(w)>;
    forward_1d_impl<S, W>(g, in, key_padding_mask, out, lse, scale);
  });
}

void backward_1d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gk,
                 const at::Tensor& gv, const at::Tensor& rel_bias, const at::Tensor& global_bias,
                 const at::Tensor& key_padding_mask, const at::Tensor& out, const at::Tensor& grad_out,
                 const at::Tensor& lse, at::Tensor grad_q, at::Tensor grad_k, at::Tensor grad_v, at::Tensor grad_gk,
                 at::Tensor grad_gv, at::Tensor grad_rel_bias, at::Tensor grad_global_bias,
                 at::IntArrayRef dilations, int64_t window, bool causal, int64_t block, double scale,
                 bool half_products) {
  const Geometry1d g = make_geometry_1d(q, gk, key_padding_mask, dilations, window, causal, block);
  const Inputs in{q, k, v, gk, gv, rel_bias, global_bias};
  Gradients grad{grad_q, grad_k, grad_v, grad_gk, grad_gv, grad_rel_bias, grad_global_bias};
  check_inputs(in,
               {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"grad_out", &grad_out}, {"grad_q", &grad_q},
                {"grad_k", &grad_k}, {"grad_v", &grad_v}},
               lse, g.bias_rows(), half_products);
  check_gradient_sums(in, grad, {g.B, g.H, g.residues}, g.bias_rows());
  dispatch(q, half_products, [&](auto s, auto* w) {
    using S = decltype(s);
    using W = std::remove_pointer_t<decltype(w)>;
    backward_1d_impl<S, W>(g, in, key_padding_mask, out, grad_out, lse, grad, scale);
  });
}

}  // namespace

TORCH_LIBRARY(vil_local_attention_cpu, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, Tensor global_bias, "
      "Tensor slots, Tensor(a!) out, Tensor(b!) lse, int window, int exact, float scale, bool half_products) -> ()");
  m.def(
      "backward(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, "
      "Tensor global_bias, Tensor slots, Tensor out, Tensor grad_out, Tensor lse, Tensor(a!) grad_q, "
      "Tensor(b!) grad_k, Tensor(c!) grad_v, Tensor(d!) grad_global_k, Tensor(e!) grad_global_v, "
      "Tensor(f!) grad_rel_bias, Tensor(g!) grad_global_bias, int window, int exact, float scale, "
      "bool half_products) -> ()");
  m.def(
      "forward_1d(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, "
      "Tensor global_bias, Tensor key_padding_mask, Tensor(a!) out, Tensor(b!) lse, int[] dilations, int window, "
      "bool causal, int block, float scale, bool half_products) -> ()");
  m.def(
      "backward_1d(Tensor q, Tensor k, Tensor v, Tensor global_k, Tensor global_v, Tensor rel_bias, "
      "Tensor global_bias, Tensor key_padding_mask, Tensor out, Tensor grad_out, Tensor lse, "
      "Tensor(a!) grad_q, Tensor(b!) grad_k, Tensor(c!) grad_v, Tensor(d!) grad_global_k, "
      "Tensor(e!) grad_global_v, Tensor(f!) grad_rel_bias, Tensor(g!) grad_global_bias, int[] dilations, "
      "int window, bool causal, int block, float scale, bool half_products) -> ()");
}

TORCH_LIBRARY_IMPL(vil_local_attention_cpu, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
  m.impl("forward_1d", &forward_1d);
  m.impl("backward_1d", &backward_1d);
}
