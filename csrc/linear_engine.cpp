#include "linear_engine.h"

#include <algorithm>
#include <vector>

#include "moe_engine.h"  // global_pool()
#include "tile_path.h"

namespace hetmoe {
namespace {

using engine::act_quant_for;
using engine::bf16_dot;
using engine::bf16_rows;
using engine::bf16_x;
using engine::ActBuffers;
using engine::f32_to_bf16;
using engine::item_rows;
using engine::sized;
using engine::uninit;

// Per-worker scratch: one dequantized panel (and its bf16 rounding), the item's output block before
// the epilogue.
struct LinearScratch {
  std::vector<float> panel, block;
  std::vector<uint16_t> bf16;
};
thread_local LinearScratch tl_linear;
thread_local engine::GroupTiles tl_own_tiles;  // an item's own packed tokens (LinearJob::chunk_acts)

class LinearJob final : public Job {
 public:
  LinearJob(const Proj& w, const float* bias, const KernelTable* kt, int gemv_max, const std::vector<int>& bounds,
            const void* x, int x_dtype, int T, void* y, int y_dtype, int threads)
      : w_(w), bias_(bias), kt_(kt), x_(x), x_dtype_(x_dtype), y_(y), y_dtype_(y_dtype), T_(T),
        gemv_(T <= gemv_max) {
    N_ = w.n;
    K_ = w.k;
    // Each node's rows (numa_split.h; all of them on a one-node pool) in items of equal size.
    const int parts = static_cast<int>(bounds.size()) - 1;
    for (int j = 0; j < parts; ++j) {
      const int r0 = bounds[j], r1 = bounds[j + 1];
      items_.add(r0, r1, item_rows(w, std::max(1, r1 - r0), 4 * std::max(1, threads / parts)));
    }
    rows_ = items_.max_rows();
    const int row_items = items_.chunks();
    // Few row items (a small N) leave workers idle: split the tokens as well. Each token chunk
    // dequantizes its panels again, so only as many chunks as the pool needs, and never chunks of
    // fewer than one GEMM register block's worth of tokens.
    token_chunk_ = std::max(T, 1);
    if (!gemv_ && row_items < 2 * threads) {
      const int chunks = std::min((2 * threads + row_items - 1) / row_items, std::max(1, T / 8));
      token_chunk_ = (T + chunks - 1) / chunks;
    }
    items_.repeat(T > 0 ? (T + token_chunk_ - 1) / token_chunk_ : 0);
    if (x_dtype_ == kBF16Data) xf_ = uninit<float>(size_t(T) * K_);
    xh_ = bf16_x(kt, x, x_dtype);
    if (gemv_)  // the GEMM path reads fp32 rows
      x_act_.allocate(T, K_, act_quant_for(kt, w.method, K_, T), engine::act_one_digit(w.method),
                      engine::float_gemv_wide(T));
    // AMX: each token chunk packed once (phase 1) for all its row items (engine::GroupTiles), or by its
    // item where it has one (moe_engine.cpp: MoEJob's experts the same way).
    if (!gemv_ && engine::tile_gemm(kt) && T > 0) {
      forms_ = engine::tile_forms(kt, x_dtype_ != kBF16Data, w, w);
      std::vector<int> counts;
      for (int t0 = 0; t0 < T; t0 += token_chunk_) counts.push_back(std::min(token_chunk_, T - t0));
      if (row_items > 1) x_tiles_.plan(counts, K_, forms_);
    }
  }

  Phase next_phase(int index) override {
    switch (index) {
      case 0:  // activations to fp32, and to int16 blocks for integer GEMV kernels; one token an item
        return {x_dtype_ == kBF16Data || x_act_.mode != kActNone ? T_ : 0, [this](int t, int) { prepare(t); }};
      case 1:  // the tile path's token chunks packed, 16 tokens an item
        return {x_tiles_.items(), [this](int i, int) { pack_tile(i); }};
      case 2:  // output rows (and token chunks) as independent items, node by node
        return items_.phase([this](int i, int) { compute(i); });
      default:
        return {};
    }
  }

 private:
  const float* x_row(int t) const {
    return x_dtype_ == kBF16Data ? xf_.get() + size_t(t) * K_ : static_cast<const float*>(x_) + size_t(t) * K_;
  }

  void prepare(int t) {
    if (x_dtype_ == kBF16Data)
      kt_->bf16_to_f32(static_cast<const uint16_t*>(x_) + size_t(t) * K_, xf_.get() + size_t(t) * K_, K_);
    x_act_.quantize(kt_, x_row(t), t);
  }

  // Phase 1's item: 16 of a token chunk's tokens into x_tiles_.
  void pack_tile(int item) {
    int chunk, row, n;
    x_tiles_.locate(item, chunk, row, n);
    pack(x_tiles_, item, chunk * token_chunk_ + row, n);
  }
  // Tokens [t0, t0 + n) (n <= 16) as tile `item` of `tiles`.
  void pack(engine::GroupTiles& tiles, int item, int t0, int n) const {
    const float* rows[16];
    for (int i = 0; i < n; ++i) rows[i] = x_row(t0 + i);
    tiles.pack(kt_, item, rows, n);
  }
  // Token chunk `chunk` ([t0, t1)) packed: phase 1's, or, where it has a single item, packed here into
  // the calling thread's tiles.
  engine::TileActs chunk_acts(int chunk, int t0, int t1) const {
    if (x_tiles_.items()) return x_tiles_.acts(chunk);
    return tl_own_tiles.pack_alone(t1 - t0, K_, forms_, [&](engine::GroupTiles& t, int item, int row, int n) {
      pack(t, item, t0 + row, n);
    });
  }

  // Item i: rows [first, last) for tokens [t0, t1), into a scratch block [t1 - t0, rows_], then the
  // epilogue (bias, conversion) into y.
  void compute(int item) {
    int chunk, first, last;
    items_.locate(item, chunk, first, last);
    const int t0 = chunk * token_chunk_, t1 = std::min(T_, t0 + token_chunk_);
    const int nt = t1 - t0, R = last - first;
    float* block = sized(tl_linear.block, size_t(std::max(nt, kGemvTokens)) * rows_);
    if (gemv_) {
      for (int a = 0; a < nt; a += kGemvTokens) {
        const int n = std::min(kGemvTokens, nt - a);
        Act acts[kGemvTokens];
        for (int i = 0; i < n; ++i) {
          acts[i] = x_act_.act(x_row(t0 + a + i), t0 + a + i);
          if (xh_) acts[i].h = xh_ + size_t(t0 + a + i) * K_;
        }
        kt_->gemv[w_.method](w_, 0, first, last, acts, n, block + size_t(a) * rows_, rows_);
      }
    } else if (engine::tile_gemm(kt_)) {  // AMX: the chunk's tokens packed once (phase 1, or here)
      engine::tile_rows(kt_, w_, 0, first, last, chunk_acts(chunk, t0, t1), block, rows_);
    } else if (x_dtype_ == kBF16Data && bf16_dot(kt_)) {
      // A bf16 model: VDPBF16PS on bf16 rows (other methods' dequantized and rounded, engine_common.h).
      std::vector<const uint16_t*> rows(nt);
      for (int i = 0; i < nt; ++i) rows[i] = static_cast<const uint16_t*>(x_) + size_t(t0 + i) * K_;
      for (int n0 = first; n0 < last; n0 += kPanelRows) {
        const int n1 = std::min(last, n0 + kPanelRows);
        const engine::Bf16Rows w = bf16_rows(kt_, w_, 0, n0, n1, tl_linear.panel, tl_linear.bf16);
        kt_->gemm_bf16(w.w, w.stride, n1 - n0, K_, rows.data(), nt, block + (n0 - first), rows_);
      }
    } else {
      std::vector<const float*> rows(nt);
      for (int i = 0; i < nt; ++i) rows[i] = x_row(t0 + i);
      float* panel = sized(tl_linear.panel, size_t(kPanelRows) * K_);
      for (int n0 = first; n0 < last; n0 += kPanelRows) {
        const int n1 = std::min(last, n0 + kPanelRows);
        kt_->dequant_rows[w_.method](w_, 0, n0, n1, panel);
        kt_->gemm_panel(panel, n1 - n0, K_, rows.data(), nt, block + (n0 - first), rows_);
      }
    }
    for (int i = 0; i < nt; ++i) {
      const float* src = block + size_t(i) * rows_;
      const size_t out = size_t(t0 + i) * N_ + first;
      if (y_dtype_ == kBF16Data) {
        uint16_t* dst = static_cast<uint16_t*>(y_) + out;
        for (int r = 0; r < R; ++r) dst[r] = f32_to_bf16(bias_ ? src[r] + bias_[first + r] : src[r]);
      } else {
        float* dst = static_cast<float*>(y_) + out;
        for (int r = 0; r < R; ++r) dst[r] = bias_ ? src[r] + bias_[first + r] : src[r];
      }
    }
  }

  Proj w_;
  const float* bias_;
  const KernelTable* kt_;
  const void* x_;
  int x_dtype_;
  void* y_;
  int y_dtype_, T_;
  bool gemv_;
  engine::NodeRowItems items_;  // phase 2's: each node's output rows, once per token chunk
  int N_ = 0, K_ = 0, rows_ = 0, token_chunk_ = 1;  // rows_: the largest item's
  engine::Buf<float> xf_;
  const uint16_t* xh_ = nullptr;  // x itself where the GEMVs may read it in bf16 (Act::h)
  ActBuffers x_act_;
  engine::TileForms forms_;     // what the tile GEMM reads
  engine::GroupTiles x_tiles_;  // the token chunks packed for the tile GEMMs, a group each
};

}  // namespace

LinearEngine::LinearEngine(const Proj& weight, const float* bias, const KernelTable* kernels, int gemv_max_tokens)
    : w_(weight), bias_(bias), kt_(kernels), gemv_max_(gemv_max_tokens) {
  const NumaTopology& topology = global_pool()->topology();
  bounds_ = hetmoe::node_bounds(w_.n, w_.s_row_div, topology);
  move_node_rows(w_, 1, bounds_, topology);
}

int64_t LinearEngine::submit(const void* x, int x_dtype, int tokens, void* y, int y_dtype) {
  std::shared_ptr<ThreadPool> pool = global_pool();
  auto job = std::make_shared<LinearJob>(w_, bias_, kt_, gemv_max_, bounds_, x, x_dtype, tokens, y, y_dtype,
                                         pool->threads());
  const int64_t handle = jobs_.add(job);
  pool->submit(std::move(job));
  return handle;
}

bool LinearEngine::wait(int64_t handle) { return jobs_.wait(handle); }

int LinearEngine::pending() const { return jobs_.size(); }

}  // namespace hetmoe
