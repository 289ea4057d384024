// Block-sparse flash attention for CPU, forward only, fp32.
//
// One task per (batch * head, query block): the query block is one tile, its listed key blocks are
// read where they lie (no packing copy) a few at a time, and an online softmax keeps the running
// row maximum, row sum and output accumulator in a per-thread workspace. GEMMs go through the BLAS
// that torch links (the reference ``sgemm_`` interface: MKL in x86 wheels).
//
// Why not torch's fused CPU SDPA on packed blocks: it splits a 128-query row into 32-query tiles
// (its tile size follows the query length), which runs such rows at about 0.7x of dense SDPA's
// FLOP rate; here every GEMM is [query block x D] . [D x key block].

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

// Key tokens per softmax step: enough columns to amortise rescaling the accumulator, few enough
// that the score tile stays in L2 (256 and 512 measured alike at D=128, 256 ahead at D=64).
constexpr int64_t kScoreCols = 256;

// Key blocks shorter than this are copied into one contiguous tile per softmax step, so a step is
// two GEMMs instead of two per block: at 64-token blocks and head dim 32 each in-place GEMM is
// 64 x 64 x 32, where the BLAS call costs about as much as the arithmetic (the kernel ran at a
// third of SDPA's FLOP rate there). From 128 tokens on the blocks are read in place (the copy
// would cost more than the calls it saves).
constexpr int64_t kPackBelow = 128;

// Column-major BLAS GEMM: C = alpha * op(A) . op(B) + beta * C.
void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int m32 = m, n32 = n, k32 = k, lda32 = lda, ldb32 = ldb, ldc32 = ldc;
  sgemm_(&transa, &transb, &m32, &n32, &k32, &alpha, a, &lda32, b, &ldb32, &beta, c, &ldc32);
}

struct Problem {
  const float* q;          // [BN, sq, d]
  const float* k;          // [BN, sk, d]
  const float* v;          // [BN, sk, dv]
  const int64_t* ids;      // [BN, nq, width], -1 padded
  float* out;              // [BN, sq, dv]
  float* lse;              // [BN, sq]: log-sum-exp of each query's scaled scores
  int64_t sq, sk, d, dv, nq, width, q_block, kv_block;
  int64_t group;           // key blocks per softmax step
  int64_t score_ld;        // row stride of the score tile: group * kv_block
  float scale;
  bool pack;               // copy each step's key blocks into one tile (short blocks)
};

// Per-thread buffers, reused across the tasks a thread runs.
struct Workspace {
  std::vector<float> scores, acc, row_max, row_sum, k_tile, v_tile;
  std::vector<int64_t> blocks;

  explicit Workspace(const Problem& p)
      : scores(p.q_block * p.score_ld), acc(p.q_block * p.dv), row_max(p.q_block),
        row_sum(p.q_block), k_tile(p.pack ? p.score_ld * p.d : 0),
        v_tile(p.pack ? p.score_ld * p.dv : 0) {
    blocks.reserve(p.width);
  }
};

// exp(row - new_max) in place; returns the row's sum.
float exponentiate(float* row, int64_t cols, float new_max) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < cols; ++j) {
    row[j] = std::exp(row[j] - new_max);
    total += row[j];
  }
  return total;
}

// Fold a [rows x cols] score tile into the running softmax state; leaves probabilities in place.
void online_softmax(const Problem& p, Workspace& w, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = w.scores.data() + i * p.score_ld;
    float new_max = w.row_max[i];
    for (int64_t j = 0; j < cols; ++j) new_max = std::max(new_max, row[j]);
    const float correction = std::exp(w.row_max[i] - new_max);
    w.row_sum[i] = w.row_sum[i] * correction + exponentiate(row, cols, new_max);
    w.row_max[i] = new_max;
    if (correction != 1.f) {
      float* acc_row = w.acc.data() + i * p.dv;
#pragma omp simd
      for (int64_t c = 0; c < p.dv; ++c) acc_row[c] *= correction;
    }
  }
}

void attend_query_block(const Problem& p, Workspace& w, int64_t head, int64_t qb) {
  const int64_t rows = std::min(p.q_block, p.sq - qb * p.q_block);
  const float* q_tile = p.q + (head * p.sq + qb * p.q_block) * p.d;
  const float* k = p.k + head * p.sk * p.d;
  const float* v = p.v + head * p.sk * p.dv;
  const int64_t* ids = p.ids + (head * p.nq + qb) * p.width;
  std::fill_n(w.acc.begin(), rows * p.dv, 0.f);
  // Lowest finite rather than -inf: the kernel is built with -ffast-math (vectorised exp).
  std::fill_n(w.row_max.begin(), rows, std::numeric_limits<float>::lowest());
  std::fill_n(w.row_sum.begin(), rows, 0.f);
  w.blocks.clear();
  std::copy_if(ids, ids + p.width, std::back_inserter(w.blocks), [](int64_t id) { return id >= 0; });

  const int64_t count = w.blocks.size();
  for (int64_t first = 0; first < count; first += p.group) {
    const int64_t last = std::min(count, first + p.group);
    if (p.pack) {
      // Copy this step's key and value rows into contiguous tiles: one GEMM each below.
      int64_t cols = 0;
      for (int64_t b = first; b < last; ++b) {
        const int64_t start = w.blocks[b] * p.kv_block;
        const int64_t n = std::min(p.kv_block, p.sk - start);
        std::copy_n(k + start * p.d, n * p.d, w.k_tile.data() + cols * p.d);
        std::copy_n(v + start * p.dv, n * p.dv, w.v_tile.data() + cols * p.dv);
        cols += n;
      }
      gemm('T', 'N', cols, rows, p.d, p.scale, w.k_tile.data(), p.d, q_tile, p.d, 0.f,
           w.scores.data(), p.score_ld);
      online_softmax(p, w, rows, cols);
      gemm('N', 'N', p.dv, rows, cols, 1.f, w.v_tile.data(), p.dv, w.scores.data(), p.score_ld,
           1.f, w.acc.data(), p.dv);
      continue;
    }
    // scores [rows x cols] = scale * Q_tile . K_block^T per key block; the tail block is short.
    // Row-major C = A . B^T is column-major C^T = B . A^T.
    int64_t cols = 0;
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = w.blocks[b] * p.kv_block;
      const int64_t n = std::min(p.kv_block, p.sk - start);
      gemm('T', 'N', n, rows, p.d, p.scale, k + start * p.d, p.d, q_tile, p.d, 0.f,
           w.scores.data() + cols, p.score_ld);
      cols += n;
    }
    online_softmax(p, w, rows, cols);
    // acc [rows x dv] += P [rows x cols] . V_blocks [cols x dv].
    cols = 0;
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = w.blocks[b] * p.kv_block;
      const int64_t n = std::min(p.kv_block, p.sk - start);
      gemm('N', 'N', p.dv, rows, n, 1.f, v + start * p.dv, p.dv, w.scores.data() + cols,
           p.score_ld, 1.f, w.acc.data(), p.dv);
      cols += n;
    }
  }
  float* out = p.out + (head * p.sq + qb * p.q_block) * p.dv;
  float* lse = p.lse + head * p.sq + qb * p.q_block;
  for (int64_t i = 0; i < rows; ++i) {
    // A query block without key blocks gets zeros and the lowest float as its log-sum-exp.
    const bool attended = w.row_sum[i] > 0.f;
    const float inv = attended ? 1.f / w.row_sum[i] : 0.f;
    lse[i] = attended ? w.row_max[i] + std::log(w.row_sum[i]) : std::numeric_limits<float>::lowest();
#pragma omp simd
    for (int64_t c = 0; c < p.dv; ++c) out[i * p.dv + c] = w.acc[i * p.dv + c] * inv;
  }
}

}  // namespace

// q [BN, Sq, D], k [BN, Sk, D], v [BN, Sk, Dv] fp32; block_index int64 [BN, nq, K] key-block ids,
// -1 padded anywhere, each id at most once per row. Returns (out [BN, Sq, Dv], lse [BN, Sq]).
std::tuple<torch::Tensor, torch::Tensor> block_sparse_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                     torch::Tensor block_index, int64_t q_block,
                                     int64_t kv_block, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [BN, S, D]");
  for (const auto& t : {q, k, v}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "q, k, v must be CPU fp32");
  }
  TORCH_CHECK(q.size(0) == k.size(0) && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                  q.size(2) == k.size(2),
              "q, k, v shapes do not fit together");
  TORCH_CHECK(block_index.scalar_type() == at::kLong && block_index.dim() == 3 &&
                  block_index.size(0) == q.size(0),
              "block_index must be int64 [BN, nq, K]");
  TORCH_CHECK(q_block >= 1 && kv_block >= 1, "block sizes must be positive");
  const int64_t nk = (k.size(1) + kv_block - 1) / kv_block;
  TORCH_CHECK(block_index.size(1) == (q.size(1) + q_block - 1) / q_block,
              "block_index has ", block_index.size(1), " query blocks; q has ",
              (q.size(1) + q_block - 1) / q_block);
  TORCH_CHECK(block_index.numel() == 0 || block_index.max().item<int64_t>() < nk,
              "block_index lists a key block >= ", nk, " (the number of key blocks)");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  block_index = block_index.contiguous();
  auto out = torch::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  auto lse = torch::empty({q.size(0), q.size(1)}, q.options());
  const int64_t group = std::max<int64_t>(1, kScoreCols / kv_block);
  const Problem p{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                  block_index.data_ptr<int64_t>(), out.data_ptr<float>(), lse.data_ptr<float>(),
                  q.size(1), k.size(1),
                  q.size(2), v.size(2), block_index.size(1), block_index.size(2), q_block,
                  kv_block, group, group * kv_block, static_cast<float>(scale),
                  kv_block < kPackBelow};
  at::parallel_for(0, q.size(0) * p.nq, 1, [&](int64_t begin, int64_t end) {
    Workspace w(p);
    for (int64_t task = begin; task < end; ++task) attend_query_block(p, w, task / p.nq, task % p.nq);
  });
  return {out, lse};
}

namespace {

// out = (x1 cos - x2 sin, x1 sin + x2 cos) per interleaved channel pair, computed in fp32 and
// rounded once to T. x, out: [rows = B * S * N, 2 * half] contiguous; cos, sin: [S, half] fp32.
template <typename T>
void rope_rows(const T* x, const float* cos, const float* sin, T* out, int64_t batch_seq,
               int64_t seq, int64_t heads, int64_t half) {
  at::parallel_for(0, batch_seq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bs = begin; bs < end; ++bs) {
      const float* c = cos + (bs % seq) * half;
      const float* s = sin + (bs % seq) * half;
      for (int64_t n = 0; n < heads; ++n) {
        const T* xr = x + (bs * heads + n) * 2 * half;
        T* o = out + (bs * heads + n) * 2 * half;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = static_cast<float>(xr[2 * j]);
          const float x2 = static_cast<float>(xr[2 * j + 1]);
          o[2 * j] = static_cast<T>(x1 * c[j] - x2 * s[j]);
          o[2 * j + 1] = static_cast<T>(x1 * s[j] + x2 * c[j]);
        }
      }
    }
  });
}

}  // namespace

// Wan's rotary embedding in one pass: x [B, S, N, D] (fp32, bf16 or fp16), cos/sin [S, D/2]
// fp32. Reads x once and writes the output once, where the eager torch form makes several
// passes over half-size strided views plus a dtype conversion.
torch::Tensor rope_rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "x must be [B, S, N, D] with D even");
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "rope_rotate runs on CPU tensors");
  const int64_t half = x.size(3) / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == x.size(1) * half && sin.numel() == cos.numel(),
              "cos and sin must be fp32 with S * D/2 values");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = torch::empty_like(x);
  const int64_t batch_seq = x.size(0) * x.size(1);
  switch (x.scalar_type()) {
    case at::kFloat:
      rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                out.data_ptr<float>(), batch_seq, x.size(1), x.size(2), half);
      break;
    case at::kBFloat16:
      rope_rows(x.data_ptr<at::BFloat16>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                out.data_ptr<at::BFloat16>(), batch_seq, x.size(1), x.size(2), half);
      break;
    case at::kHalf:
      rope_rows(x.data_ptr<at::Half>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                out.data_ptr<at::Half>(), batch_seq, x.size(1), x.size(2), half);
      break;
    default:
      TORCH_CHECK(false, "rope_rotate takes fp32, bf16 or fp16, got ", x.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_rotate", &rope_rotate, "Wan rotary embedding, one pass, fp32 arithmetic",
        py::call_guard<py::gil_scoped_release>());
  // The GIL is released: the kernel touches no Python object, other Python threads may run.
  m.def("block_sparse_attention", &block_sparse_attention,
        "Block-sparse flash attention on CPU (fp32, forward)",
        py::call_guard<py::gil_scoped_release>());
}
